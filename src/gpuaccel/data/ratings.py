"""Ratings for recommendation: (user, item, rating) triples.

Read from MovieLens' own files (``u.data``, ``u1.base`` with its ``u1.test``, ``ua.base``,
``ratings.dat`` with ``::`` separators) or from a CSV/TSV whose header names the user, item
and rating columns (``userId,movieId,rating,timestamp`` as MovieLens' newer releases have it).
A folder is read as its ``u1.base``/``u1.test`` split where it has one (the split most
papers report RMSE on), else its ratings file with a seeded held-out share.

Ids become dense indices from 1, in order of first appearance in the training split; index 0
stands for a user or item the training split never saw. Test ratings of such unknown users or
items are counted and kept: a model's row 0 is never trained, so they are predicted from what
is known (the mean and the other side's bias), which is how cold starts are served.

For top-k recommendation (``--task ranking``) every rating is an interaction: each user's
latest is held out and ranked against sampled items the user never interacted with
(:func:`load_interactions`), and training pairs interactions with random negatives drawn on
the device each epoch (:class:`NegativeSamples`, a resident loader's tensors).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError
from . import cache

RATING_FILES = ("u1.base", "u.data", "ratings.dat", "ratings.csv", "ratings.tsv")
USER_NAMES = ("user", "userid", "user_id", "users")
ITEM_NAMES = ("item", "itemid", "item_id", "movieid", "movie_id", "movie", "product", "productid")
RATING_NAMES = ("rating", "ratings", "score", "stars")
TIME_NAMES = ("timestamp", "time", "date")
TITLE_FILES = ("u.item", "movies.dat", "movies.csv")


class _IdMaps:
    """Dense indices of users and items (from 1; 0: not seen in training) and their original ids."""

    user_ids: list[str]
    item_ids: list[str]

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)


@dataclass
class Ratings(_IdMaps):
    """Ratings as dense indices (users and items from 1; 0 = not seen in training)."""

    name: str
    train_users: np.ndarray
    train_items: np.ndarray
    train_ratings: np.ndarray
    test_users: np.ndarray
    test_items: np.ndarray
    test_ratings: np.ndarray
    user_ids: list[str]  # the original id of each user index (index 0: unknown)
    item_ids: list[str]
    source: str = ""
    titles: dict[str, str] = field(default_factory=dict)  # item id -> title, where the data has titles
    split: str = ""
    fingerprint: str = ""
    side_features: dict = field(default_factory=dict)  # {"user": {...}, "item": {...}}: read_side_features

    @property
    def rating_range(self) -> tuple[float, float]:
        return float(self.train_ratings.min()), float(self.train_ratings.max())

    @property
    def cold(self) -> tuple[int, int]:
        """Test ratings by users, and of items, that the training split never saw."""
        return int((self.test_users == 0).sum()), int((self.test_items == 0).sum())

    def describe(self) -> str:
        lo, hi = self.rating_range
        users, items = self.cold
        return (f"{self.name}: {len(self.train_ratings):,} train / {len(self.test_ratings):,} test ratings "
                f"({self.split}), {self.num_users - 1:,} users x {self.num_items - 1:,} items, ratings {lo:g}-{hi:g}"
                + (f"; test ratings of unseen users {users}, of unseen items {items}" if users or items else "")
                + "".join(f"; {side} features {', '.join(sorted(names))}"
                          for side, names in self.side_features.items() if names))


def is_ratings_source(path: Path) -> bool:
    if path.is_dir():
        return any((path / name).is_file() for name in RATING_FILES)
    name = path.name.lower()
    if name.endswith(".base") or name in ("u.data", "ratings.dat"):
        return True
    if name.endswith((".csv", ".tsv")):
        try:
            header = _header(path)
        except (OSError, UnicodeDecodeError):
            return False
        return _find(header, USER_NAMES) is not None and _find(header, ITEM_NAMES) is not None
    return False


def _header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        first = f.readline()
    return [c.strip().lower() for c in first.split("\t" if path.suffix.lower() == ".tsv" else ",")]


def _find(columns: list[str], names: tuple[str, ...]) -> int | None:
    return next((i for i, c in enumerate(columns) if c.replace(" ", "") in names), None)


def read_triples(path: Path) -> tuple[list[str], list[str], np.ndarray, np.ndarray | None]:
    """(user ids, item ids, ratings, timestamps or None) of one ratings file, in file order."""
    name = path.name.lower()
    try:
        if name.endswith((".csv", ".tsv")):
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f, delimiter="\t" if name.endswith(".tsv") else ","))
            if not rows:
                raise GpuaccelError(f"{path} is empty")
            header = [c.strip().lower() for c in rows[0]]
            found = [_find(header, names) for names in (USER_NAMES, ITEM_NAMES, RATING_NAMES)]
            missing = [what for what, i in zip(("user", "item", "rating"), found) if i is None]
            if missing:
                raise GpuaccelError(f"{path}: no {' or '.join(missing)} column in its header ({', '.join(rows[0])}); "
                                    f"name them e.g. user, item, rating")
            time_column = _find(header, TIME_NAMES)
            needed = max(found) + 1
            for line, r in enumerate(rows[1:], 2):
                if r and len(r) < needed:
                    raise GpuaccelError(f"{path}: line {line} has {len(r)} field(s); the header names {len(header)} "
                                        f"({', '.join(rows[0])})")
            rows = [[r[i] for i in found] + ([r[time_column]] if time_column is not None and time_column < len(r)
                                             else []) for r in rows[1:] if r]
        else:  # MovieLens' own files: user, item, rating (0.5-5 stars), timestamp on each line
            separator = "::" if name.endswith(".dat") else "\t"
            with open(path, encoding="utf-8") as f:
                rows = []
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    fields = line.rstrip("\n").rstrip("\r").split(separator)
                    if len(fields) != 4:
                        raise GpuaccelError(f"{path}: line {number} has {len(fields)} field(s); a MovieLens ratings "
                                            f"file has 4 on each line (user, item, rating, timestamp)")
                    if _is_number(fields[2]) and not 0.5 <= float(fields[2]) <= 5:
                        raise GpuaccelError(f"{path}: line {number} rates {fields[2].strip()!r}; MovieLens ratings are "
                                            f"0.5 to 5 stars (other scales: a CSV with a rating column)")
                    rows.append(fields)
    except UnicodeDecodeError as exc:
        raise GpuaccelError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not rows:
        raise GpuaccelError(f"{path} holds no ratings")
    for line, row in enumerate(rows, 1):
        if len(row) < 3:
            raise GpuaccelError(f"{path}: rating {line} has {len(row)} field(s); each needs user, item and rating")
        if not row[0].strip() or not row[1].strip():
            raise GpuaccelError(f"{path}: rating {line} has an empty {'user' if not row[0].strip() else 'item'} id; "
                                f"remove or fix that row")
    try:
        ratings = np.array([float(r[2]) for r in rows], dtype=np.float32)
    except ValueError:
        line, bad = next((i, r[2]) for i, r in enumerate(rows, 1) if not _is_number(r[2]))
        raise GpuaccelError(f"{path}: rating {line} is {bad!r}, not a number; remove or fix that row") from None
    finite = np.isfinite(ratings)
    if not finite.all():  # "nan" and "inf" parse as numbers; as targets they make every loss NaN
        line = int(np.argmin(finite)) + 1
        raise GpuaccelError(f"{path}: rating {line} is {rows[line - 1][2].strip()!r}, not a finite number; "
                            f"remove or fix that row")
    times = None
    if all(len(r) > 3 and _is_number(r[3]) for r in rows):
        times = np.array([float(r[3]) for r in rows])
    return [r[0].strip() for r in rows], [r[1].strip() for r in rows], ratings, times


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def rating_files(path: Path) -> tuple[Path, Path | None, str]:
    """(training file, test file or None, what the split is)."""
    if path.is_dir():
        found = next((path / n for n in RATING_FILES if (path / n).is_file()), None)
        if found is None:
            raise GpuaccelError(f"{path} holds no ratings file ({', '.join(RATING_FILES)})")
        path = found
    if path.name.lower().endswith(".base"):
        test = path.with_suffix(".test")
        if not test.is_file():
            raise GpuaccelError(f"{path} has no {test.name} beside it (a .base file's test split)")
        return path, test, f"{path.name}/{test.name}"
    return path, None, ""


def read_titles(folder: Path) -> dict[str, str]:
    """Item id -> title from MovieLens' u.item (Latin-1, '|'), movies.dat ('::') or movies.csv."""
    for name in TITLE_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name == "movies.csv":
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                return {row[0]: row[1] for row in list(csv.reader(f))[1:] if len(row) > 1}
        separator = "|" if name == "u.item" else "::"
        text = path.read_bytes().decode("utf-8" if name != "u.item" else "latin-1", errors="replace")
        return {parts[0]: parts[1] for parts in (line.split(separator) for line in text.splitlines()) if len(parts) > 1}
    return {}


AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens 1M's age groups; 100K's exact ages are grouped alike


def read_side_features(folder: Path, user_ids: list[str], item_ids: list[str]) -> dict[str, dict[str, list]]:
    """Users' and items' side features where the folder has MovieLens' files for them:
    ``u.user`` or ``users.dat`` (age group, gender, occupation), ``u.item``, ``movies.dat`` or
    ``movies.csv`` (genres, release decade). Per index (0: unknown) a categorical feature is a
    code from 1 (0: not known), and genres a multi-hot row; {} for a side without its file."""
    def codes(values: dict[str, str], ids: list[str]) -> list[int]:
        vocabulary = {v: i for i, v in enumerate(dict.fromkeys(values.values()), 1)}
        return [vocabulary.get(values.get(i), 0) for i in ids]

    def age_group(age: str) -> str:
        return str(int(np.searchsorted(AGE_EDGES, int(age), side="right"))) if age.strip().isdigit() else ""

    users: dict[str, list] = {}
    for name, separator, order in (("u.user", "|", (1, 2, 3)), ("users.dat", "::", (2, 1, 3))):
        if (folder / name).is_file():
            rows = [line.split(separator) for line in _lines(folder / name)]
            rows = [r for r in rows if len(r) >= 4]
            for feature, column in zip(("age", "gender", "occupation"), order):
                users[feature] = codes({r[0]: age_group(r[column]) if feature == "age" else r[column].strip()
                                        for r in rows}, user_ids)
            break
    items: dict[str, list] = {}
    genres: dict[str, list[str]] = {}
    years: dict[str, str] = {}
    if (folder / "u.item").is_file():
        names = [line.split("|")[0] for line in _lines(folder / "u.genre") if "|" in line] \
            if (folder / "u.genre").is_file() else []
        for r in (line.split("|") for line in _lines(folder / "u.item")):
            if len(r) > 5:
                flags = r[5:]
                genres[r[0]] = [names[k] if k < len(names) else str(k) for k, f in enumerate(flags) if f.strip() == "1"]
                years[r[0]] = r[2][-4:]
    else:
        for name in ("movies.dat", "movies.csv"):
            if (folder / name).is_file():
                lines = _lines(folder / name)
                rows = [line.split("::") for line in lines] if name.endswith(".dat") else list(csv.reader(lines[1:]))
                for r in (r for r in rows if len(r) >= 3):
                    genres[r[0]] = [g for g in r[2].split("|") if g and g != "(no genres listed)"]
                    years[r[0]] = r[1].strip()[-5:-1]
                break
    if genres:
        vocabulary = {g: k for k, g in enumerate(dict.fromkeys(g for gs in genres.values() for g in gs))}
        rows = []
        for item in item_ids:
            row = [0.0] * len(vocabulary)
            for g in genres.get(item, ()):
                row[vocabulary[g]] = 1.0
            rows.append(row)
        items["genres"] = rows
        items["decade"] = codes({i: y[:3] for i, y in years.items() if y.isdigit()}, item_ids)
    return {"user": users, "item": items}


def _lines(path: Path) -> list[str]:
    """MovieLens' small files are Latin-1 (u.item, u.user) or UTF-8 (the newer ones)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return [line for line in text.splitlines() if line.strip()]


def load_ratings(path: Path, *, val_split: float | None = None, seed: int = 0,
                 cache_dir: Path | None = None) -> Ratings:
    path = Path(path)
    train_file, test_file, split = rating_files(path)
    files = [f for f in (train_file, test_file) if f is not None]
    key, digest = cache.file_identity("ratings", path, files, {} if test_file else {"val_split": val_split, "seed": seed})
    name = (path if path.is_dir() else path.parent).name or train_file.stem
    titles = read_titles(train_file.parent)
    hit = cache.load(cache_dir, key)
    if hit is not None:
        meta = hit["meta"]
        return Ratings(name, *(hit[k] for k in ("train_users", "train_items", "train_ratings", "test_users",
                                                 "test_items", "test_ratings")),
                       meta["user_ids"], meta["item_ids"], str(path), titles, meta["split"], digest,
                       read_side_features(train_file.parent, meta["user_ids"], meta["item_ids"]))
    users, items, ratings, _ = read_triples(train_file)
    if test_file is not None:
        test_users, test_items, test_ratings, _ = read_triples(test_file)
    else:
        share = 0.1 if val_split is None else val_split
        if not 0 < share < 1:
            raise GpuaccelError(f"--val-split must be in (0, 1), got {share}")
        order = np.random.default_rng(seed).permutation(len(ratings))
        held = np.zeros(len(ratings), dtype=bool)
        held[order[:max(1, int(len(ratings) * share))]] = True
        test_users = [u for u, h in zip(users, held) if h]
        test_items = [i for i, h in zip(items, held) if h]
        test_ratings = ratings[held]
        users = [u for u, h in zip(users, held) if not h]
        items = [i for i, h in zip(items, held) if not h]
        ratings = ratings[~held]
        split = f"{train_file.name}, {100 * share:g}% held out (seed {seed})"
    user_ids, item_ids = ["<unknown>"] + list(dict.fromkeys(users)), ["<unknown>"] + list(dict.fromkeys(items))
    user_index, item_index = {u: i for i, u in enumerate(user_ids)}, {v: i for i, v in enumerate(item_ids)}
    user_index.pop("<unknown>")
    item_index.pop("<unknown>")

    def indices(ids, index):
        return np.array([index.get(v, 0) for v in ids], dtype=np.int64)

    data = Ratings(name, indices(users, user_index), indices(items, item_index), ratings,
                   indices(test_users, user_index), indices(test_items, item_index),
                   np.asarray(test_ratings, dtype=np.float32), user_ids, item_ids, str(path), titles, split, digest,
                   read_side_features(train_file.parent, user_ids, item_ids))
    cache.save(cache_dir, key, {"user_ids": user_ids, "item_ids": item_ids, "split": split},
               **{k: getattr(data, k) for k in ("train_users", "train_items", "train_ratings", "test_users",
                                                 "test_items", "test_ratings")})
    return data


# ---------------------------------------------------------------------------------- implicit feedback

INTERACTION_FILES = ("u.data", "ratings.dat", "ratings.csv", "ratings.tsv", "u1.base")


@dataclass
class Interactions(_IdMaps):
    """Implicit feedback split leave-one-out: each user's latest interaction is the test item,
    ranked against ``negatives`` items the user never interacted with (row i of ``test_items``:
    the held-out item, then its negatives)."""

    name: str
    train_users: np.ndarray
    train_items: np.ndarray
    test_users: np.ndarray
    test_items: np.ndarray  # (test users, 1 + negatives)
    user_ids: list[str]
    item_ids: list[str]
    source: str = ""
    titles: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_users):,} train interactions, {len(self.test_users):,} users' latest "
                f"held out, each ranked against {self.test_items.shape[1] - 1} unseen items; "
                f"{self.num_users - 1:,} users x {self.num_items - 1:,} items")


def load_interactions(path: Path, *, negatives: int = 99, seed: int = 0,
                      cache_dir: Path | None = None) -> Interactions:
    """Every rating as an interaction, split leave-one-out by time (file order breaks ties)."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in INTERACTION_FILES if (path / n).is_file()), None)
        if found is None:
            raise GpuaccelError(f"{path} holds no ratings file ({', '.join(INTERACTION_FILES)})")
        file = found
    else:
        file = path
    key, digest = cache.file_identity("interactions", path, [file], {"negatives": negatives, "seed": seed})
    name = (path if path.is_dir() else path.parent).name or file.stem
    titles = read_titles(file.parent)
    hit = cache.load(cache_dir, key)
    if hit is not None:
        meta = hit["meta"]
        return Interactions(name, hit["train_users"], hit["train_items"], hit["test_users"], hit["test_items"],
                            meta["user_ids"], meta["item_ids"], str(path), titles, digest)
    users, items, _, times = read_triples(file)
    user_ids, item_ids = ["<unknown>"] + list(dict.fromkeys(users)), ["<unknown>"] + list(dict.fromkeys(items))
    user_index = {u: i for i, u in enumerate(user_ids) if i}
    item_index = {v: i for i, v in enumerate(item_ids) if i}
    u = np.array([user_index[v] for v in users], dtype=np.int64)
    i = np.array([item_index[v] for v in items], dtype=np.int64)
    order = np.lexsort((np.arange(len(u)), times if times is not None else np.arange(len(u)), u))
    u, i = u[order], i[order]
    pairs = np.unique(u * len(item_ids) + i, return_index=True)[1]  # a repeated (user, item) counts once
    keep = np.zeros(len(u), dtype=bool)
    keep[pairs] = True
    u, i = u[keep], i[keep]  # (np.unique kept the first of each pair: the order by time survives)
    last = np.flatnonzero(np.r_[u[1:] != u[:-1], True])  # each user's latest interaction
    first = np.r_[0, last[:-1] + 1]
    held = last[last > first]  # a user with one interaction keeps it for training
    if not len(held):
        raise GpuaccelError(f"{file}: no user has two interactions; leave-one-out needs at least two")
    candidates = len(item_ids) - 1
    if negatives < 1 or negatives >= candidates:
        raise GpuaccelError(f"--eval-negatives must be in 1..{candidates - 1} (the items less one), got {negatives}")
    rng = np.random.default_rng(seed)
    test_items = np.zeros((len(held), negatives + 1), dtype=np.int64)
    for row, end in enumerate(held):
        start = first[np.searchsorted(last, end)]
        seen = set(i[start:end + 1].tolist())
        if candidates - len(seen) < negatives:
            raise GpuaccelError(f"user {user_ids[u[end]]} interacted with all but {candidates - len(seen)} items; "
                                f"--eval-negatives {negatives} cannot be drawn")
        chosen: list[int] = []
        while len(chosen) < negatives:
            for item in rng.integers(1, candidates + 1, size=2 * negatives).tolist():
                if item not in seen and len(chosen) < negatives:
                    seen.add(item)
                    chosen.append(item)
        test_items[row] = [i[end], *chosen]
    train = np.ones(len(u), dtype=bool)
    train[held] = False
    data = Interactions(name, u[train], i[train], u[held], test_items, user_ids, item_ids, str(path), titles, digest)
    cache.save(cache_dir, key, {"user_ids": user_ids, "item_ids": item_ids}, train_users=data.train_users,
               train_items=data.train_items, test_users=data.test_users, test_items=data.test_items)
    return data


class NegativeSamples:
    """Implicit feedback's training samples, drawn again each epoch on the device (a resident
    loader's tensors): every interaction (label 1) and ``negatives`` random items per
    interaction, labelled 0 unless the user did interact with the item (a sorted key list answers
    that). Seeded per epoch, so a resumed run sees the same samples; the loader shuffles them."""

    def __init__(self, users: np.ndarray, items: np.ndarray, num_items: int, *, negatives: int,
                 device: torch.device, seed: int = 0):
        self.device, self.negatives, self.num_items, self.seed = device, negatives, num_items, seed
        self.users = torch.from_numpy(users).to(device)
        self.items = torch.from_numpy(items).to(device)
        self.known = torch.sort(self.users * num_items + self.items).values

    def __len__(self) -> int:
        return len(self.users) * (1 + self.negatives)

    def __call__(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + epoch)
        users = self.users.repeat(self.negatives)
        items = torch.randint(1, self.num_items, (len(users),), generator=generator, device=self.device)
        keys = users * self.num_items + items
        found = self.known[torch.searchsorted(self.known, keys).clamp_max(len(self.known) - 1)] == keys
        return (torch.cat([self.users, users]), torch.cat([self.items, items]),
                torch.cat([torch.ones_like(self.users, dtype=torch.float32), found.float()]))
