"""Audio classifiers that take waveforms: the log-mel spectrogram is their first layer, so it
runs on the GPU with the rest and an exported model needs nothing beside it.

``LogMel``: ``torch.stft`` (a Hann window of 25 ms, 10 ms hops), the power spectrum mapped to
mel bands by triangular filters (the HTK mel scale, torchaudio's default: the same numbers
whether or not torchaudio is installed, since neither it nor librosa is needed), the log,
and each utterance normalised to zero mean and unit variance.

``SpecAugment`` (Park et al., 2019), in training only: each recording is shifted in time by
up to ``time_shift`` seconds, and random bands of mel channels and of frames are blanked.

``audio_resnet``: a small 2-D residual CNN over the (mel, time) image.
``audio_tcnn``: 1-D residual convolutions over time with the mel bands as channels
(TC-ResNet's design, Choi et al., 2019): far fewer operations, for the CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .layers import conv_bn_act, eager_forward, init_weights
from .registry import register_model
from .resnet import BasicBlock


def hz_to_mel(f):
    return 2595.0 * torch.log10(1.0 + torch.as_tensor(f, dtype=torch.float64) / 700.0)


def mel_to_hz(m):
    return 700.0 * (10.0 ** (torch.as_tensor(m, dtype=torch.float64) / 2595.0) - 1.0)


def mel_filters(n_freqs: int, sample_rate: int, n_mels: int, f_min: float = 0.0, f_max: float | None = None):
    """(n_freqs, n_mels) triangular filters, equally spaced on the HTK mel scale, unnormalised."""
    freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    edges = mel_to_hz(torch.linspace(float(hz_to_mel(f_min)), float(hz_to_mel(f_max or sample_rate / 2)), n_mels + 2,
                                     dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(rising, falling), min=0).float()


@eager_forward  # inductor generates no code for complex numbers: the FFT runs as it is
class LogMel(nn.Module):
    """(N, samples) waveforms in [-1, 1] -> (N, n_mels, frames) normalised log-mel energies."""

    def __init__(self, sample_rate: int, n_mels: int = 40, window_ms: float = 25.0, hop_ms: float = 10.0,
                 f_min: float = 20.0):
        super().__init__()
        self.win_length = int(round(sample_rate * window_ms / 1000))
        self.hop = int(round(sample_rate * hop_ms / 1000))
        self.n_fft = 2 ** math.ceil(math.log2(self.win_length))
        self.register_buffer("window", torch.hann_window(self.win_length), persistent=False)
        self.register_buffer("filters", mel_filters(self.n_fft // 2 + 1, sample_rate, n_mels, f_min), persistent=False)

    def frames(self, samples: int) -> int:
        return samples // self.hop + 1

    def forward(self, waves: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the autocast: the FFT has no bf16 kernel, and log energies span decades
        with torch.autocast(waves.device.type, enabled=False):
            spectrum = torch.stft(waves.float(), self.n_fft, self.hop, self.win_length, self.window, center=True,
                                  pad_mode="reflect", return_complex=True)
            power = spectrum.real.square() + spectrum.imag.square()  # (N, freqs, frames)
            energies = torch.log(torch.matmul(self.filters.t(), power) + 1e-6)
            mean = energies.mean((1, 2), keepdim=True)
            std = energies.std((1, 2), keepdim=True)
            return (energies - mean) / (std + 1e-5)


class SpecAugment(nn.Module):
    """Training-time augmentation on the device, a no-op in evaluation (like dropout)."""

    def __init__(self, sample_rate: int, time_shift: float = 0.1, freq_masks: int = 2, freq_width: int = 6,
                 time_masks: int = 2, time_width: int = 10):
        super().__init__()
        self.shift = int(round(time_shift * sample_rate))
        self.freq_masks, self.freq_width = freq_masks, freq_width
        self.time_masks, self.time_width = time_masks, time_width

    def shift_waves(self, waves: torch.Tensor) -> torch.Tensor:
        """Each recording moved by its own random offset, silence filling the gap."""
        if not self.training or not self.shift:
            return waves
        n, length = waves.shape
        offsets = torch.randint(-self.shift, self.shift + 1, (n, 1), device=waves.device)
        source = torch.arange(length, device=waves.device) - offsets
        inside = (source >= 0) & (source < length)
        return torch.gather(waves, 1, source.clamp(0, length - 1)) * inside

    def mask(self, features: torch.Tensor) -> torch.Tensor:
        """Zero (the normalised mean) over random bands of mel channels and of frames."""
        if not self.training:
            return features
        n, mels, frames = features.shape
        keep = torch.ones_like(features, dtype=torch.bool)
        for count, width, size, dim in ((self.freq_masks, self.freq_width, mels, 1),
                                        (self.time_masks, self.time_width, frames, 2)):
            if not count or not width:
                continue
            positions = torch.arange(size, device=features.device).view(1, 1, size)
            widths = torch.randint(0, width + 1, (n, count, 1), device=features.device)
            starts = (torch.rand(n, count, 1, device=features.device) * (size - widths + 1)).long()
            hit = ((positions >= starts) & (positions < starts + widths)).any(1)  # (n, size)
            keep &= ~(hit.unsqueeze(2) if dim == 1 else hit.unsqueeze(1))
        return features * keep


class AudioClassifier(nn.Module):
    """Waveforms -> (shift) -> log-mel -> (masks) -> ``body`` -> logits."""

    def __init__(self, features: LogMel, augment: SpecAugment, body: nn.Module):
        super().__init__()
        self.features, self.augment, self.body = features, augment, body

    def forward(self, waves: torch.Tensor) -> torch.Tensor:
        return self.body(self.augment.mask(self.features(self.augment.shift_waves(waves))))


class ResNet2d(nn.Module):
    """The (mel, time) image through a strided stem and residual stages, mean-pooled."""

    def __init__(self, num_classes: int, width: int, depths: tuple[int, ...], dropout: float):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_act(1, width // 2, 3, 1), conv_bn_act(width // 2, width, 3, 2))
        stages, in_ch = [], width
        for i, depth in enumerate(depths):
            ch = width * 2 ** i
            stages += [BasicBlock(in_ch if j == 0 else ch, ch, 2 if (j == 0 and i > 0) else 1) for j in range(depth)]
            in_ch = ch
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_ch, num_classes))
        init_weights(self)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(features.unsqueeze(1))))


class TemporalBlock(nn.Module):
    def __init__(self, in_ch: int, ch: int, stride: int, kernel: int = 9):
        super().__init__()
        pad = kernel // 2
        self.branch = nn.Sequential(nn.Conv1d(in_ch, ch, kernel, stride, pad, bias=False), nn.BatchNorm1d(ch),
                                    nn.ReLU(inplace=True), nn.Conv1d(ch, ch, kernel, 1, pad, bias=False),
                                    nn.BatchNorm1d(ch))
        self.shortcut = nn.Identity() if stride == 1 and in_ch == ch else nn.Sequential(
            nn.Conv1d(in_ch, ch, 1, stride, bias=False), nn.BatchNorm1d(ch))
        nn.init.zeros_(self.branch[-1].weight)  # the block starts as its shortcut

    def forward(self, x):
        return torch.relu(self.branch(x) + self.shortcut(x))


class TemporalCNN(nn.Module):
    def __init__(self, num_classes: int, n_mels: int, width: int, depths: tuple[int, ...], dropout: float):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_mels, width, 3, 1, 1, bias=False), nn.BatchNorm1d(width),
                                  nn.ReLU(inplace=True))
        blocks, in_ch = [], width
        for i, depth in enumerate(depths):
            ch = int(width * 1.5 ** i)
            blocks += [TemporalBlock(in_ch if j == 0 else ch, ch, 2 if j == 0 else 1) for j in range(depth)]
            in_ch = ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_ch, num_classes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(features)))


@register_model("audio_resnet")
def audio_resnet(num_classes: int, sample_rate: int = 16000, n_mels: int = 40, width: int = 32,
                 depths: tuple[int, ...] = (1, 1, 1), dropout: float = 0.1, time_shift: float = 0.1,
                 freq_masks: int = 2, freq_width: int = 6, time_masks: int = 2, time_width: int = 10) -> AudioClassifier:
    """Log-mel features, then a residual 2-D CNN (stem at stride 2, stages doubling the width)."""
    return AudioClassifier(LogMel(sample_rate, n_mels),
                           SpecAugment(sample_rate, time_shift, freq_masks, freq_width, time_masks, time_width),
                           ResNet2d(num_classes, width, tuple(depths), dropout))


@register_model("audio_tcnn")
def audio_tcnn(num_classes: int, sample_rate: int = 16000, n_mels: int = 40, width: int = 64,
               depths: tuple[int, ...] = (1, 1, 1), dropout: float = 0.1, time_shift: float = 0.1,
               freq_masks: int = 2, freq_width: int = 6, time_masks: int = 2, time_width: int = 10) -> AudioClassifier:
    """Log-mel features, then 1-D residual convolutions over time (the mel bands as channels)."""
    return AudioClassifier(LogMel(sample_rate, n_mels),
                           SpecAugment(sample_rate, time_shift, freq_masks, freq_width, time_masks, time_width),
                           TemporalCNN(num_classes, n_mels, width, tuple(depths), dropout))
