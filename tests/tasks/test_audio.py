"""Audio: the WAV reader (and its bad inputs), labels from folders or file names, the official
split by a name field, log-mel features against a NumPy reference, the augmentation, and a
spoken-digit-like run trained, inferred from and exported."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import wave
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuaccel.data import parse_spec
from gpuaccel.data.audio import BadAudio, NamePattern, decode, fit_length, load_audio, parse_condition, resample
from gpuaccel.errors import GpuaccelError
from gpuaccel.models import create_model
from gpuaccel.models.audio import LogMel, SpecAugment

from conftest import assert_user_error, run

RATE = 8000
TONES = {"0": 300.0, "1": 700.0, "2": 1500.0}  # one class per pitch: easy to learn, easy to check


def wav_bytes(samples: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    """A PCM WAV file of ``samples`` (float in [-1, 1], shape (frames,) or (frames, channels))."""
    frames = samples.reshape(len(samples), channels)
    if width == 1:
        raw = np.clip(frames * 128 + 128, 0, 255).astype(np.uint8).tobytes()
    elif width == 2:
        raw = np.clip(frames * 32767, -32768, 32767).astype("<i2").tobytes()
    else:
        ints = np.clip(frames * 2 ** 23, -2 ** 23, 2 ** 23 - 1).astype(np.int32).reshape(-1)
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return out.getvalue()


def tone(label: str, seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * TONES[label] * (1 + 0.03 * rng.standard_normal()) * t)
            + 0.02 * rng.standard_normal(len(t))).astype(np.float32)


def digit_recordings(root: Path, speakers=("ann", "bob"), indices=range(8)) -> Path:
    """FSDD's layout: {label}_{speaker}_{index}.wav in one folder, lengths 0.15-0.35 s."""
    root.mkdir(parents=True, exist_ok=True)
    for label in TONES:
        for s, speaker in enumerate(speakers):
            for i in indices:
                seed = zlib.crc32(f"{label}_{speaker}_{i}".encode())  # (hash() of strings changes per process)
                seconds = 0.15 + 0.2 * ((i * 7 + s) % 5) / 4
                (root / f"{label}_{speaker}_{i}.wav").write_bytes(wav_bytes(tone(label, seconds, seed)))
    return root


# ------------------------------------------------------------------------------ decoding

def test_pcm_wav_of_8_16_and_24_bits_decodes_to_the_same_signal():
    signal = tone("1", 0.1, 0)
    for width, tolerance in ((1, 1 / 64), (2, 1e-4), (3, 1e-6)):
        samples, rate = decode(wav_bytes(signal, width=width))
        assert rate == RATE and samples.shape == (len(signal), 1)
        assert np.abs(samples[:, 0] - signal).max() < tolerance, width


def test_stereo_is_kept_as_channels_for_the_reader_to_mix_down():
    stereo = np.stack([tone("0", 0.05, 0), np.zeros(400, np.float32)], 1)
    samples, _ = decode(wav_bytes(stereo, channels=2))
    assert samples.shape == (400, 2) and np.abs(samples[:, 1]).max() == 0


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (wav_bytes(tone("0", 0.1, 0))[:-101], "truncated"),
    (wav_bytes(tone("0", 0.1, 0))[:30], "truncated"),
    (b"RIFF" + struct.pack("<I", 36) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 3, 1, 8000, 32000, 4, 32)
     + b"data" + struct.pack("<I", 0), "not a PCM WAV"),
    (wav_bytes(np.zeros(0, np.float32)), "no samples"),
])
def test_bad_recordings_are_named_with_their_fault(data, reason, monkeypatch):
    monkeypatch.setattr("gpuaccel.data.audio.soundfile_module", lambda: None)  # the standard library's reader
    with pytest.raises(BadAudio, match=reason):
        decode(data)


def test_resampling_keeps_the_pitch_and_the_duration():
    signal = tone("1", 0.5, 0, rate=16000)
    down = resample(signal, 16000, 8000)
    assert len(down) == 4000
    peak = np.argmax(np.abs(np.fft.rfft(down))) * 8000 / len(down)
    assert abs(peak - 700) < 30


def test_short_recordings_are_centred_and_long_ones_keep_their_loudest_part():
    short, cut = fit_length(np.ones(4, np.float32), 10)
    assert not cut and short.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
    loud = np.zeros(100, np.float32)
    loud[60:70] = 1
    kept, cut = fit_length(loud, 20)
    assert cut and kept.sum() == 10


# ------------------------------------------------------------------------------ labels and splits

def test_a_name_pattern_gives_fields_and_a_condition_picks_the_test_split():
    pattern = NamePattern("{label}_{speaker}_{index}.wav")
    assert pattern.match("7_jackson_32.wav") == {"label": "7", "speaker": "jackson", "index": "32"}
    assert pattern.match("notes.wav") is None
    test = parse_condition("index<5 and speaker!=theo", pattern.fields)
    assert test({"index": "4", "speaker": "ann"}) and not test({"index": "10", "speaker": "ann"})
    assert not test({"index": "2", "speaker": "theo"})
    with pytest.raises(GpuaccelError, match="label"):
        NamePattern("{speaker}.wav")
    with pytest.raises(GpuaccelError, match="has label, speaker, index"):
        parse_condition("take<5", pattern.fields)


def test_the_official_split_holds_out_exactly_the_low_indices(tmp_path):
    root = digit_recordings(tmp_path / "recordings")
    data = load_audio(root, label_pattern="{label}_{speaker}_{index}.wav", test_where="index<5",
                      cache_dir=tmp_path / "cache")
    assert data.classes == ["0", "1", "2"] and data.sample_rate == RATE
    assert len(data.test_labels) == 3 * 2 * 5 and len(data.train_labels) == 3 * 2 * 3
    assert data.clip_samples == 0.4 * RATE  # 99% of the training lengths (<= 0.35 s), up to a tenth
    # which recordings went where: rebuilt from the files, compared waveform by waveform
    test_files = sorted(p for p in root.iterdir() if int(p.stem.split("_")[2]) < 5)
    expected = np.stack([fit_length(decode(p.read_bytes())[0][:, 0], data.clip_samples)[0] for p in test_files])
    assert np.allclose(np.sort(data.test_waves.sum(1)), np.sort(expected.sum(1)), atol=1e-4)
    train_sums = set(np.round(data.train_waves.sum(1), 4))
    assert not train_sums & set(np.round(expected.sum(1), 4))  # no test recording in training


def test_class_folders_a_tar_archive_and_mixed_rates(tmp_path):
    root = tmp_path / "speech"
    for split, count in (("train", 4), ("test", 2)):
        for label in ("0", "2"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                rate = 16000 if i == 0 else RATE
                (root / split / label / f"{i}.wav").write_bytes(wav_bytes(tone(label, 0.2, i, rate), rate=rate))
    assert parse_spec(str(root))[0] == "audio"
    data = load_audio(root, cache_dir=None)
    assert data.classes == ["0", "2"] and len(data.train_labels) == 8 and len(data.test_labels) == 4
    assert data.sample_rate == RATE and any("resampled to 8,000 Hz from 16,000 Hz" in n for n in data.notes)
    archive = tmp_path / "speech.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="speech")
    assert parse_spec(str(archive))[0] == "audio"
    packed = load_audio(archive, cache_dir=None)
    assert np.array_equal(packed.train_waves, data.train_waves) and packed.classes == data.classes


def test_unreadable_or_unmatched_files_stop_the_read_unless_skipped(tmp_path, capsys):
    root = digit_recordings(tmp_path / "rec", speakers=("ann",), indices=range(6))
    (root / "2_ann_9.wav").write_bytes(b"")
    (root / "readme.wav").write_bytes(wav_bytes(tone("0", 0.2, 1)))
    pattern = "{label}_{speaker}_{index}.wav"
    with pytest.raises(GpuaccelError, match="readme.wav does not match label_pattern"):
        load_audio(root, label_pattern=pattern, test_where="index<3")
    (root / "readme.wav").unlink()
    with pytest.raises(GpuaccelError, match="2_ann_9.wav the file is empty.*skip_bad"):
        load_audio(root, label_pattern=pattern, test_where="index<3")
    data = load_audio(root, label_pattern=pattern, test_where="index<3", skip_bad=True)
    assert len(data.skipped) == 1 and len(data.train_labels) + len(data.test_labels) == 18
    assert_user_error(capsys, ["train", "--data", str(root), "--test-where", "index<3", "--epochs", "1"],
                      "--test-where needs --label-pattern")


def test_recordings_are_decoded_once_then_read_from_the_cache(tmp_path, monkeypatch):
    root = digit_recordings(tmp_path / "rec", speakers=("ann",), indices=range(4))
    options = dict(label_pattern="{label}_{speaker}_{index}.wav", test_where="index<2", cache_dir=tmp_path / "cache")
    first = load_audio(root, **options)
    monkeypatch.setattr("gpuaccel.data.audio.decode", lambda data: (_ for _ in ()).throw(AssertionError("decoded")))
    again = load_audio(root, **options)
    assert np.array_equal(first.train_waves, again.train_waves) and again.classes == first.classes


# ------------------------------------------------------------------------------ features and augmentation

def reference_log_mel(wave_: np.ndarray, rate: int, n_mels: int) -> np.ndarray:
    """The same features written plainly in NumPy: reflect-padded frames, a periodic Hann window
    centred in the FFT size, |rfft|^2, triangular HTK-mel filters built point by point, log,
    per-utterance normalisation."""
    win, hop = int(round(rate * 0.025)), int(round(rate * 0.010))
    n_fft = 1 << (win - 1).bit_length()
    window = np.zeros(n_fft)
    start = (n_fft - win) // 2
    window[start:start + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)
    padded = np.pad(wave_.astype(np.float64), n_fft // 2, mode="reflect")
    frames = np.stack([padded[i * hop:i * hop + n_fft] for i in range(len(wave_) // hop + 1)])
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2  # (frames, freqs)

    def mel(f):
        return 2595 * np.log10(1 + f / 700)

    edges_mel = np.linspace(mel(20.0), mel(rate / 2), n_mels + 2)
    edges = 700 * (10 ** (edges_mel / 2595) - 1)
    freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    filters = np.zeros((len(freqs), n_mels))
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        for k, f in enumerate(freqs):
            if lo < f <= mid:
                filters[k, m] = (f - lo) / (mid - lo)
            elif mid < f < hi:
                filters[k, m] = (hi - f) / (hi - mid)
    energies = np.log(power @ filters + 1e-6).T
    return (energies - energies.mean()) / (energies.std(ddof=1) + 1e-5)


@pytest.mark.parametrize("rate, n_mels", [(8000, 40), (16000, 64)])
def test_log_mel_features_match_a_numpy_reference(rate, n_mels):
    signal = tone("2", 0.3, 3, rate=rate) + 0.1 * tone("0", 0.3, 4, rate=rate)
    ours = LogMel(rate, n_mels)(torch.from_numpy(signal)[None])[0].double().numpy()
    expected = reference_log_mel(signal, rate, n_mels)
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() < 2e-3


def test_log_mel_matches_torchaudio_where_it_is_installed():
    torchaudio = pytest.importorskip("torchaudio")
    signal = torch.from_numpy(tone("1", 0.3, 5))[None]
    features = LogMel(RATE, 40)
    theirs = torchaudio.transforms.MelSpectrogram(RATE, n_fft=features.n_fft, win_length=features.win_length,
                                                  hop_length=features.hop, f_min=20.0, n_mels=40)(signal)
    theirs = torch.log(theirs + 1e-6)
    theirs = (theirs - theirs.mean()) / (theirs.std() + 1e-5)
    assert torch.allclose(features(signal), theirs, atol=2e-3)


def test_augmentation_changes_training_inputs_only():
    augment = SpecAugment(RATE, time_shift=0.05, freq_masks=2, freq_width=4, time_masks=2, time_width=5)
    waves = torch.from_numpy(np.stack([tone("0", 0.3, i) for i in range(16)]))
    features = torch.randn(16, 40, 31)
    augment.eval()
    assert augment.shift_waves(waves) is waves and augment.mask(features) is features
    augment.train()
    torch.manual_seed(0)
    shifted = augment.shift_waves(waves)
    assert shifted.shape == waves.shape and not torch.equal(shifted, waves)
    masked = augment.mask(features)
    blanked = masked == 0
    assert blanked.any() and blanked.float().mean() < 0.5
    # whole bands: a blanked mel channel is blank in every frame, a blanked frame in every channel
    band = blanked.all(2) | blanked.all(1).unsqueeze(1).expand(-1, 40, -1).any(2)
    assert band.any()


# ------------------------------------------------------------------------------ a run end to end

def test_spoken_digits_train_infer_and_export(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    root = digit_recordings(tmp_path / "recordings", speakers=("ann", "bob", "cy"), indices=range(10))
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, "train", "--recipe", "fsdd", "--data", str(root), "--device", "cpu", "--epochs",
                         "8", "--batch-size", "16", "--model-args", "width=16", "--test-where", "index<3",
                         "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache"), "--json", "--no-monitor",
                         "--no-compile")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["metrics"]["accuracy"] >= 0.9  # three pitches; chance is 1/3
    state = torch.load(run_dir / "model.pt", weights_only=False)
    assert state["audio"] == {"sample_rate": RATE, "clip_samples": int(0.4 * RATE)}

    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "high.wav").write_bytes(wav_bytes(tone("2", 0.6, 99, rate=16000), rate=16000))  # longer, other rate
    (loose / "low.wav").write_bytes(wav_bytes(np.stack([tone("0", 0.2, 98)] * 2, 1), channels=2))
    code, out, err = run(capsys, "infer", str(run_dir), str(loose / "low.wav"), str(loose), "--device", "cpu")
    assert code == 0, err
    rows = [line.split(",") for line in out.strip().splitlines()[1:]]
    assert [Path(r[0]).name for r in rows] == ["low.wav", "high.wav", "low.wav"]
    assert [r[1] for r in rows] == ["0", "2", "0"]
    assert "resampled from 16,000 to 8,000 Hz" in err and "mixed down to mono" in err

    code, out, err = run(capsys, "export", str(run_dir), "--format", "onnx", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] and report["recordings"] == 27 and report["max_abs_diff"] < 1e-3
    meta = json.loads(Path(report["artifact"] + ".json").read_text())
    assert meta["sample_rate"] == RATE and meta["classes"] == ["0", "1", "2"]
    # the artefact alone labels recordings (resampled, mixed down) as the run does
    code, out, err = run(capsys, "infer", report["artifact"], str(loose / "low.wav"), str(loose))
    assert code == 0, err
    assert [r.split(",")[1] for r in out.strip().splitlines()[1:]] == ["0", "2", "0"]
    assert "3 recordings with onnxruntime on cpu" in err and "resampled from 16,000 to 8,000 Hz" in err
    # int8, calibrated on training recordings; the quantised file infers too
    code, out, err = run(capsys, "quantize", str(run_dir), "--int8", "--calib", "32", "--json")
    assert code == 0, err
    quantized = json.loads(out)
    assert quantized["unit"] == "recordings" and quantized["calibration_samples"] == 32
    assert quantized["int8"]["test_accuracy"] >= 0.8
    code, out, err = run(capsys, "infer", quantized["artifact"], str(loose))
    assert code == 0 and [r.split(",")[1] for r in out.strip().splitlines()[1:]] == ["2", "0"], err
    # a file that cannot be read: one line naming it, or with --skip-bad left out and named
    (loose / "broken.wav").write_bytes(b"RIFF\x00\x00")
    code, out, err = run(capsys, "infer", str(run_dir), str(loose))
    assert code == 2 and "broken.wav" in err and "--skip-bad leaves such files out" in err
    code, out, err = run(capsys, "infer", str(run_dir), str(loose), "--skip-bad")
    assert code == 0 and len(out.strip().splitlines()) == 3 and "skipped " in err and "broken.wav" in err, err


def test_audio_models_take_waveforms_of_any_batch():
    for name in ("audio_resnet", "audio_tcnn"):
        model = create_model(name, num_classes=5, sample_rate=RATE, required=()).eval()
        assert model(torch.randn(3, 4000) * 0.1).shape == (3, 5)
