"""Ratings: MovieLens files, or a CSV/TSV with user, item and rating columns (data/ratings.py);
rating regression, or top-k ranking from the ratings as implicit feedback (``--task ranking``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.kinds import DataKind, register_kind
from ..data.ratings import NegativeSamples, is_ratings_source, load_interactions, load_ratings
from ..runtime.loaders import ResidentLoader
from ..settings import check_whole, setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class RatingsOptions:
    """The settings only ratings read: how many negatives training and ranking draw."""
    negatives: int = setting(4, "ratings with --task ranking: random items drawn per interaction as negatives "
                                "in training, each epoch", metavar="N")
    eval_negatives: int = setting(99, "ratings with --task ranking: unseen items each user's held-out item is "
                                      "ranked against", metavar="N")


class Ratings(DataKind):
    name = "ratings"
    settings = ()
    options = RatingsOptions
    detect_order = 20
    description = "ratings (MovieLens files, or a CSV/TSV with user, item and rating columns)"
    default_model = "matrix_factorization"
    default_task = "regression (ranking with --task ranking)"

    def validate_options(self, data) -> None:
        check_whole(data, "negatives")
        check_whole(data, "eval_negatives")

    def detect(self, path: Path) -> str | None:
        return self.name if is_ratings_source(path) else None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        if config.model.task == "ranking":
            return self._interactions(config, path, dist)
        data = shared_read(dist, lambda: load_ratings(path, val_split=config.data.val_split, seed=config.loop.seed,
                                                      cache_dir=cache_dir_of(config)))
        identity = {"train_samples": len(data.train_ratings), "test_samples": len(data.test_ratings),
                    "users": data.num_users, "items": data.num_items, "files": data.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            return tuple(ResidentLoader(tuple(torch.from_numpy(getattr(data, f"{split}_{part}"))
                                              for part in ("users", "items", "ratings")),
                                        batch_size=size, train=split == "train", **common)
                         for split, size in (("train", config.loop.batch_size), ("test", config.loop.eval_batch_size)))

        return TrainingInputs(
            name=data.name, description=data.describe(), train_samples=len(data.train_ratings),
            test_samples=len(data.test_ratings),
            model_args={"num_users": data.num_users, "num_items": data.num_items,
                        "rating_mean": round(float(data.train_ratings.mean()), 6),
                        "rating_range": list(data.rating_range),
                        # (a model that takes them, e.g. neural_mf; an empty side is None)
                        **{f"{side}_features": data.side_features.get(side) or None for side in ("user", "item")}},
            identity=identity, task="regression", unit="ratings", default_model="matrix_factorization",
            ratings={"user_ids": data.user_ids, "item_ids": data.item_ids}, build=build, data_kind=self.name,
            init_sample=lambda loader: loader.tensors)  # every training rating: (users, items, ratings)

    def _interactions(self, config, path, dist) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        data = shared_read(dist, lambda: load_interactions(path, negatives=config.data.eval_negatives,
                                                           seed=config.loop.seed,
                                                           cache_dir=cache_dir_of(config)))
        identity = {"train_samples": len(data.train_users), "test_samples": len(data.test_users),
                    "users": data.num_users, "items": data.num_items, "eval_negatives": config.data.eval_negatives,
                    "files": data.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            samples = NegativeSamples(data.train_users, data.train_items, data.num_items,
                                      negatives=config.data.negatives, device=device, seed=config.loop.seed)
            train = ResidentLoader(samples, batch_size=config.loop.batch_size, train=True, **common)
            test = ResidentLoader((torch.from_numpy(data.test_users), torch.from_numpy(data.test_items),
                                   torch.zeros(len(data.test_users), dtype=torch.long)),  # the held-out item: column 0
                                  batch_size=config.loop.eval_batch_size, train=False, **common)
            return train, test

        return TrainingInputs(
            name=data.name, description=data.describe(),
            train_samples=len(data.train_users) * (1 + config.data.negatives), test_samples=len(data.test_users),
            model_args={"num_users": data.num_users, "num_items": data.num_items, "rating_mean": 0.0,
                        "rating_range": None},
            identity=identity, task="ranking", unit="pairs", default_model="matrix_factorization",
            ratings={"user_ids": data.user_ids, "item_ids": data.item_ids}, build=build, data_kind=self.name)

    def owned_before_kinds(self, state: dict) -> bool:
        return bool(state.get("ratings"))


register_kind(Ratings())
