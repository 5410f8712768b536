"""Audio classification data: recordings labelled by their class folder (``train/<class>/
*.wav``, like image folders) or by a file-name pattern (``{label}_{speaker}_{index}.wav``),
in a folder or a .tar[.gz] archive.

Each recording is decoded once (the standard library's ``wave`` reads PCM WAV;
``soundfile``, when installed, also reads float WAV, FLAC and Ogg), mixed down to mono,
resampled to one rate and fitted to one length: shorter ones are centred in silence,
longer ones keep their loudest stretch. The result is one float32 array per split, cached
on disk and held on the device while training. Features (the log-mel spectrogram) are the
model's first layer (models/audio.py), so an exported model takes waveforms.
"""

from __future__ import annotations

import io
import operator
import os
import re
import tarfile
import wave
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GpuaccelError
from . import cache
from .dataset import stratified_split
from .formats import TEST_SPLIT_NAMES, common_root, split_tree

WAV_SUFFIXES = (".wav", ".wave")
SOUNDFILE_SUFFIXES = (".flac", ".ogg")  # read only when soundfile is installed
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def soundfile_module():
    try:
        import soundfile
    except (ImportError, OSError):  # OSError: the package is there but libsndfile is not
        return None
    return soundfile


def is_audio_name(name: str) -> bool:
    name = name.lower()
    return name.endswith(WAV_SUFFIXES) or (name.endswith(SOUNDFILE_SUFFIXES) and soundfile_module() is not None)


class BadAudio(Exception):
    """A recording that cannot be used; the message says why."""


# ---------------------------------------------------------------------------------- one recording

def decode(data: bytes) -> tuple[np.ndarray, int]:
    """(samples, channels) float32 in [-1, 1] and the sample rate, from a file's bytes."""
    if not data:
        raise BadAudio("the file is empty")
    soundfile = soundfile_module()
    if soundfile is not None:
        try:
            samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except Exception as exc:  # soundfile raises its own error type, or RuntimeError
            raise BadAudio(f"cannot be decoded ({str(exc).strip().splitlines()[0][:120]})") from None
        if len(samples) == 0:
            raise BadAudio("holds no samples")
        return samples, int(rate)
    return _decode_pcm_wav(data)


def _decode_pcm_wav(data: bytes) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(data)) as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(frames)
    except wave.Error as exc:
        raise BadAudio(f"is not a PCM WAV file ({exc}); convert it to 16-bit PCM, or pip install soundfile to "
                       f"read float WAV, FLAC and Ogg") from None
    except EOFError:
        raise BadAudio("is truncated inside its header") from None
    if frames == 0 or not raw:
        raise BadAudio("holds no samples")
    whole = len(raw) // (width * channels)
    if whole < frames:
        raise BadAudio(f"is truncated: its header promises {frames} frames, the file holds {whole}")
    if width == 1:  # 8-bit WAV is unsigned
        values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        values = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:  # 24-bit: sign-extend three little-endian bytes into the top of an int32
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((triples[:, 0] << 8 | triples[:, 1] << 16 | triples[:, 2] << 24) >> 8).astype(np.float32) / 2 ** 23
    elif width == 4:
        values = np.frombuffer(raw, "<i4").astype(np.float32) / 2 ** 31
    else:
        raise BadAudio(f"has {8 * width}-bit samples, which WAV does not define")
    return values.reshape(-1, channels), rate


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling of a 1-D signal by zero-padding or truncating its spectrum (what
    scipy.signal.resample does): frequencies above the lower Nyquist limit are removed."""
    if rate == target:
        return samples
    n_out = max(1, int(round(len(samples) * target / rate)))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    kept = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    n = min(len(kept), len(spectrum))
    kept[:n] = spectrum[:n]
    return (np.fft.irfft(kept, n_out) * (n_out / len(samples))).astype(np.float32)


def fit_length(samples: np.ndarray, length: int) -> tuple[np.ndarray, bool]:
    """(``length`` samples, whether the recording was cut): a shorter recording centred in
    silence, a longer one cut to its loudest stretch of ``length`` samples."""
    out = np.zeros(length, dtype=np.float32)
    if len(samples) <= length:
        start = (length - len(samples)) // 2
        out[start:start + len(samples)] = samples
        return out, False
    energy = np.concatenate([[0.0], np.cumsum(samples.astype(np.float64) ** 2)])
    start = int(np.argmax(energy[length:] - energy[:-length]))
    out[:] = samples[start:start + length]
    return out, True


# ---------------------------------------------------------------------------------- labels from names

class NamePattern:
    """A file-name pattern such as ``{label}_{speaker}_{index}.wav``: each ``{field}`` matches
    a run of characters (the shortest that lets the rest match); ``{label}`` is required."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        parts = re.split(r"\{(\w+)\}", pattern)
        self.fields = parts[1::2]
        if "label" not in self.fields:
            raise GpuaccelError(f"--label-pattern {pattern!r} has no {{label}} field; e.g. '{{label}}_{{speaker}}_"
                                f"{{index}}.wav'")
        if len(set(self.fields)) != len(self.fields):
            raise GpuaccelError(f"--label-pattern {pattern!r} names a field twice")
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" for i, p in enumerate(parts))
        self._regex = re.compile(regex + "$", re.IGNORECASE)

    def match(self, file_name: str) -> dict[str, str] | None:
        found = self._regex.match(file_name)
        return found.groupdict() if found else None


_COMPARISONS = {"<=": operator.le, ">=": operator.ge, "!=": operator.ne, "==": operator.eq, "<": operator.lt,
                ">": operator.gt, "=": operator.eq}


def parse_condition(text: str, fields: list[str]) -> Callable[[dict], bool]:
    """``index<5`` or ``speaker==theo and index<5``: which recordings are the test split. Values
    compare as numbers when both sides are numbers, else as text."""
    tests = []
    for clause in re.split(r"\s+and\s+", text.strip()):
        found = re.fullmatch(r"\s*(\w+)\s*(<=|>=|!=|==|<|>|=)\s*(\S+)\s*", clause)
        if not found:
            raise GpuaccelError(f"--test-where {text!r}: each condition is FIELD OP VALUE (OP one of < <= > >= == "
                                f"!=), joined by 'and'; e.g. 'index<5'")
        name, op, value = found.groups()
        if name not in fields:
            raise GpuaccelError(f"--test-where names field {name!r}; the --label-pattern has {', '.join(fields)}")
        tests.append((name, _COMPARISONS[op], value))

    def holds(values: dict) -> bool:
        return all(compare(*_comparable(values[name], value)) for name, compare, value in tests)

    return holds


def _comparable(a: str, b: str):
    try:
        return float(a), float(b)
    except ValueError:
        return a, b


# ---------------------------------------------------------------------------------- the data set

@dataclass
class AudioDataset:
    """Recordings as float32 (N, samples) waveforms at ``sample_rate``, with class labels."""

    name: str
    train_waves: np.ndarray
    train_labels: np.ndarray
    test_waves: np.ndarray
    test_labels: np.ndarray
    classes: list[str]
    sample_rate: int
    source: str = ""
    notes: list[str] = field(default_factory=list)  # what was done to make the recordings uniform
    skipped: list[str] = field(default_factory=list)
    fingerprint: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def clip_samples(self) -> int:
        return int(self.train_waves.shape[1])

    def describe(self) -> str:
        text = (f"{self.name}: {len(self.train_labels):,} train / {len(self.test_labels):,} test recordings, "
                f"{self.clip_samples / self.sample_rate:g} s at {self.sample_rate:,} Hz, {self.num_classes} classes")
        extra = self.notes + ([f"{len(self.skipped)} unreadable skipped"] if self.skipped else [])
        return text + (f" ({'; '.join(extra)})" if extra else "")


def is_audio_source(path: Path) -> bool:
    """A folder whose first file is a recording, or an archive whose first file member is one."""
    if path.is_dir():
        for _, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            named = [f for f in sorted(files) if not f.startswith(".")]
            if named:
                return any(is_audio_name(f) for f in named)
        return False
    if path.name.lower().endswith(_TAR_SUFFIXES):
        try:
            with tarfile.open(path, "r:*") as archive:
                for member in archive:
                    if member.isfile() and not Path(member.name).name.startswith("."):
                        return is_audio_name(member.name)
        except (tarfile.TarError, OSError, EOFError):
            return False
    return False


def _list_folder(root: Path):
    names, fingerprint = [], []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if is_audio_name(f) and not f.startswith("."):
                full = os.path.join(folder, f)
                st = os.stat(full)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                names.append(rel)
                fingerprint.append((rel, st.st_size, st.st_mtime_ns))

    def read_all(wanted: list[str]) -> dict[str, bytes]:
        return {n: (root / n).read_bytes() for n in wanted}

    return names, read_all, fingerprint


def _list_archive(path: Path):
    try:
        with tarfile.open(path, "r:*") as archive:
            members = [m for m in archive.getmembers() if m.isfile() and is_audio_name(m.name)
                       and not Path(m.name).name.startswith(".")]
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise GpuaccelError(f"cannot read the archive {path}: {exc}") from None
    st = path.stat()

    def read_all(wanted: list[str]) -> dict[str, bytes]:
        wanted_set, out = set(wanted), {}
        with tarfile.open(path, "r:*") as archive:  # one sequential pass over the compressed stream
            for member in archive:
                name = member.name.removeprefix("./")
                if name in wanted_set:
                    out[name] = archive.extractfile(member).read()
        return out

    return [m.name.removeprefix("./") for m in members], read_all, [path.name, st.st_size, st.st_mtime_ns]


def _assign(names: list[str], pattern: NamePattern | None, test_where: str | None, source):
    """{name: (split, label)} and the names whose file name does not match the pattern."""
    prefix = common_root(names)
    relative = {n: n[len(prefix):] for n in names}
    if pattern is None:
        if test_where:
            raise GpuaccelError("--test-where needs --label-pattern: its fields come from the file names")
        splits, _ = split_tree(list(relative.values()))
        if "train" not in splits:
            raise GpuaccelError(f"{source}: no recordings in class folders (expected train/<class>/*.wav or "
                                f"<class>/*.wav); for labels in file names give --label-pattern, e.g. "
                                f"'{{label}}_{{speaker}}_{{index}}.wav'")
        back = {r: n for n, r in relative.items()}
        return {back[r]: (split, cls) for split, classes in splits.items() for cls, rs in classes.items()
                for r in rs}, []
    condition = parse_condition(test_where, pattern.fields) if test_where else None
    assigned, unmatched = {}, []
    for name, rel in relative.items():
        values = pattern.match(rel.rsplit("/", 1)[-1])
        if values is None:
            unmatched.append(name)
            continue
        if condition is not None:
            split = "test" if condition(values) else "train"
        else:
            split = "test" if "/" in rel and rel.split("/", 1)[0].lower() in TEST_SPLIT_NAMES else "train"
        assigned[name] = (split, values["label"])
    return assigned, unmatched


def _label_order(labels) -> list[str]:
    """Class names sorted as numbers when they all are (digits 0..9 keep their own indices)."""
    unique = set(labels)
    try:
        return sorted(unique, key=lambda v: (float(v), v))
    except ValueError:
        return sorted(unique)


def load_audio(path: Path, *, label_pattern: str | None = None, test_where: str | None = None,
               sample_rate: int | None = None, clip_seconds: float | None = None, val_split: float | None = None,
               skip_bad: bool = False, seed: int = 0, cache_dir: Path | None = None) -> AudioDataset:
    """Reads, decodes and fits the recordings at ``path`` (from the cache when nothing changed)."""
    path = Path(path)
    if sample_rate is not None and (not isinstance(sample_rate, int) or sample_rate < 1000):
        raise GpuaccelError(f"--sample-rate is in Hz, at least 1000, got {sample_rate}")
    if clip_seconds is not None and not clip_seconds > 0:
        raise GpuaccelError(f"--clip-seconds must be positive, got {clip_seconds}")
    names, read_all, fingerprint = _list_archive(path) if path.is_file() else _list_folder(path)
    if not names:
        raise GpuaccelError(f"{path}: no recordings found (.wav{'' if soundfile_module() is None else ', .flac, .ogg'})")
    pattern = NamePattern(label_pattern) if label_pattern else None
    assigned, unmatched = _assign(names, pattern, test_where, path)
    if unmatched and not skip_bad:
        raise GpuaccelError(f"{unmatched[0]} does not match --label-pattern {label_pattern!r} ({len(unmatched)} "
                            f"file(s) do not); fix the pattern, or pass --skip-bad to skip them")
    options = {"pattern": label_pattern, "test_where": test_where, "sample_rate": sample_rate,
               "clip_seconds": clip_seconds, "skip_bad": skip_bad}
    key = cache.cache_key("audio", fingerprint, options)
    digest = cache.fingerprint_digest(fingerprint)
    hit = cache.load(cache_dir, key)
    if hit is None:
        hit = _decode_all(path, sorted(assigned), assigned, read_all, sample_rate, clip_seconds, skip_bad)
        hit["meta"]["bad"] += [f"{n}: does not match the label pattern" for n in unmatched]
        cache.save(cache_dir, key, hit["meta"], **{k: v for k, v in hit.items() if k != "meta"})
    meta = hit["meta"]
    waves, labels, is_test = hit["waves"], hit["labels"], hit["is_test"].astype(bool)
    if not is_test.any():
        train_x, train_y, test_x, test_y = stratified_split(
            waves, labels, 0.1 if val_split is None else val_split, seed)
    elif val_split is not None:
        raise GpuaccelError(f"{path} already has a test split; --val-split is only for data without one")
    else:
        train_x, train_y, test_x, test_y = waves[~is_test], labels[~is_test], waves[is_test], labels[is_test]
    if len(train_y) == 0 or len(test_y) == 0:
        raise GpuaccelError(f"{path}: the {'training' if len(train_y) == 0 else 'test'} split has no recordings"
                            + (f" (--test-where {test_where!r})" if test_where else ""))
    name = path.name.split(".")[0] if path.is_file() else path.name
    return AudioDataset(name, train_x, train_y, test_x, test_y, meta["classes"], meta["sample_rate"], str(path),
                        meta["notes"], meta["bad"], digest)


def _decode_all(path, ordered, assigned, read_all, sample_rate, clip_seconds, skip_bad) -> dict:
    contents = read_all(ordered)
    decoded, bad, stereo = [], [], 0
    for name in ordered:
        try:
            samples, rate = decode(contents[name])
        except BadAudio as exc:
            if not skip_bad:
                raise GpuaccelError(f"{path}: {name} {exc}; fix or remove it, or pass --skip-bad to skip unreadable "
                                    f"recordings") from None
            bad.append(f"{name}: {exc}")
            continue
        stereo += samples.shape[1] > 1
        decoded.append((name, samples.mean(1), rate))
    if not decoded:
        raise GpuaccelError(f"{path}: no recording could be read ({bad[0] if bad else 'none found'})")
    rates = Counter(rate for _, _, rate in decoded)
    target = sample_rate or rates.most_common(1)[0][0]
    notes = [f"{stereo} multi-channel recording(s) mixed down to mono"] if stereo else []
    changed = {r: c for r, c in rates.items() if r != target}
    if changed:
        notes.append(f"{sum(changed.values())} recording(s) resampled to {target:,} Hz from "
                     + ", ".join(f"{r:,} Hz" for r in sorted(changed)))
    waves = [resample(samples, rate, target) for _, samples, rate in decoded]
    train_lengths = [len(w) for (name, _, _), w in zip(decoded, waves) if assigned[name][0] == "train"]
    if clip_seconds:
        length = max(1, int(round(clip_seconds * target)))
    else:  # the length 99% of the training recordings fit in, rounded up to a tenth of a second
        tenth = target / 10
        length = int(np.ceil(np.percentile(train_lengths or [len(w) for w in waves], 99) / tenth) * tenth)
    fitted = [fit_length(w, length) for w in waves]
    cut = sum(was_cut for _, was_cut in fitted)
    if cut:
        notes.append(f"{cut} recording(s) longer than {length / target:g} s cut to their loudest {length / target:g} s")
    classes = _label_order(assigned[name][1] for name, _, _ in decoded)
    index = {c: i for i, c in enumerate(classes)}
    return {"meta": {"classes": classes, "sample_rate": target, "notes": notes, "bad": bad},
            "waves": np.stack([w for w, _ in fitted]),
            "labels": np.array([index[assigned[n][1]] for n, _, _ in decoded], dtype=np.int64),
            "is_test": np.array([assigned[n][0] == "test" for n, _, _ in decoded])}


def recording_files(inputs: list[str]) -> list[Path]:
    """The recordings that ``inputs`` name: files, and the recordings in folders, in order."""
    files: list[Path] = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and is_audio_name(f.name))
        elif p.is_file():
            files.append(p)
        else:
            raise GpuaccelError(f"{name} does not exist")
    if not files:
        raise GpuaccelError(f"no recordings in {', '.join(inputs)}")
    return files


def decode_recordings(files: list[Path], sample_rate: int, length: int, *, skip_bad: bool = False,
                      notes: list[str]) -> tuple[list[str], np.ndarray]:
    """(names, (N, length) waveforms) of ``files``, made like the training recordings (mono,
    ``sample_rate``, centred or cut to ``length``); what was converted or skipped is added to
    ``notes``. A file that cannot be decoded is an error naming it, or with ``skip_bad`` left out."""
    waves, kept = [], []
    for f in files:
        try:
            samples, rate = decode(f.read_bytes())
        except BadAudio as exc:
            if not skip_bad:
                raise GpuaccelError(f"{f} {exc}; --skip-bad leaves such files out") from None
            notes.append(f"skipped {f}: {exc}")
            continue
        kept.append(f)
        if samples.shape[1] > 1:
            notes.append(f"{f.name}: mixed down to mono")
        if rate != sample_rate:
            notes.append(f"{f.name}: resampled from {rate:,} to {sample_rate:,} Hz")
        waves.append(fit_length(resample(samples.mean(1), rate, sample_rate), length)[0])
    return [str(f) for f in kept], (np.stack(waves) if waves else np.zeros((0, length), np.float32))

