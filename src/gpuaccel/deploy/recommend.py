"""Top-k recommendations from a trained rating model: every item the user has not rated in
training, scored in one batch on the device, best first, with titles where the data has them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data import parse_spec
from ..data.cache import default_cache_dir
from ..data.ratings import load_interactions, load_ratings, read_titles
from ..train.config import saved_settings
from ..device import resolve_device
from ..errors import GpuaccelError
from .artifact import load_run_state, rebuild_model


@dataclass
class Recommendation:
    item: str  # the item's id in the data
    title: str | None
    score: float  # the predicted rating, or (a model trained for ranking) its score


def recommend(run, user: str, top: int = 10, *, device: str = "auto", include_rated: bool = False) -> list[Recommendation]:
    """The ``top`` items with the highest predicted rating for ``user`` (an id of the data)."""
    if top < 1:
        raise GpuaccelError("--top must be at least 1")
    state, path = load_run_state(run)
    if not state.get("ratings"):
        raise GpuaccelError(f"{path} is not a recommender (it was not trained on ratings)")
    user_ids, item_ids = state["ratings"]["user_ids"], state["ratings"]["item_ids"]
    try:
        user_index = user_ids.index(str(user), 1)
    except ValueError:
        raise GpuaccelError(f"user {user!r} has no ratings in the run's training data ({len(user_ids) - 1:,} users, "
                            f"ids such as {', '.join(user_ids[1:4])})") from None
    config = saved_settings(state["config"])
    _, data_path = parse_spec(config["data"])
    candidates = np.arange(1, len(item_ids))
    if not include_rated:
        if state["task"].get("name") == "ranking":
            data = load_interactions(data_path, negatives=config.get("eval_negatives", 99), seed=config.get("seed", 0),
                                     cache_dir=default_cache_dir())
        else:
            data = load_ratings(data_path, val_split=config.get("val_split"), seed=config.get("seed", 0),
                                cache_dir=default_cache_dir())
        seen = np.unique(data.train_items[data.train_users == user_index])
        candidates = np.setdiff1d(candidates, seen)
    target = resolve_device(device)
    model = rebuild_model(state, path).eval().to(target)
    with torch.no_grad():
        items = torch.from_numpy(candidates).to(target)
        scores = model(torch.full_like(items, user_index), items).float()
        best = torch.topk(scores, min(top, len(candidates)))
    titles = read_titles(Path(data_path) if Path(data_path).is_dir() else Path(data_path).parent)
    return [Recommendation(item_ids[int(candidates[i])], titles.get(item_ids[int(candidates[i])]), float(v))
            for v, i in zip(best.values.cpu(), best.indices.cpu())]
