"""Ratings: MovieLens files and CSVs read into dense ids (and back), unseen users and items in the
test split, bad input, a matrix-factorisation run that beats the global mean, and recommend;
top-k from implicit feedback: the leave-one-out split, negatives, HR@k and NDCG@k, a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpuaccel.data import parse_spec
from gpuaccel.data.ratings import NegativeSamples, load_interactions, load_ratings
from gpuaccel.errors import GpuaccelError
from gpuaccel.models import create_model
from gpuaccel.runtime.loaders import ResidentLoader
from gpuaccel.tasks import Ranking

from conftest import assert_user_error, run


def low_rank_ratings(users=60, items=40, share=0.6, seed=0):
    """(user, item, rating) triples from rank-2 tastes, rounded to 1-5 stars."""
    rng = np.random.default_rng(seed)
    taste, traits = rng.normal(0, 1, (users, 2)), rng.normal(0, 1, (items, 2))
    rows = []
    for u in range(users):
        for i in range(items):
            if rng.random() < share:
                stars = np.clip(np.round(3 + taste[u] @ traits[i] + 0.3 * rng.standard_normal()), 1, 5)
                rows.append((u + 1, i + 1, int(stars), 880000000 + len(rows)))
    rng.shuffle(rows)
    return rows


def movielens_folder(root, rows, test_share=0.2):
    root.mkdir(parents=True, exist_ok=True)
    cut = int(len(rows) * (1 - test_share))
    for name, part in (("u1.base", rows[:cut]), ("u1.test", rows[cut:]), ("u.data", rows)):
        (root / name).write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in part))
    items = sorted({i for _, i, _, _ in rows})
    (root / "u.item").write_bytes("".join(f"{i}|Film n\xb0{i} (1995)|01-Jan-1995||http://x|0|1\n" for i in items)
                                  .encode("latin-1"))
    return root


def test_movielens_ids_round_trip_and_unseen_test_users_are_counted(tmp_path):
    rows = low_rank_ratings()
    rows.append((999, 1, 4, 0))  # a user who appears only in the test split
    root = movielens_folder(tmp_path / "ml", rows[:-1])
    with open(root / "u1.test", "a") as f:
        f.write("999\t1\t4\t0\n")
    assert parse_spec(str(root))[0] == "ratings"
    data = load_ratings(root, cache_dir=tmp_path / "cache")
    assert data.split == "u1.base/u1.test"
    base = [line.split("\t") for line in (root / "u1.base").read_text().splitlines()]
    assert [data.user_ids[u] for u in data.train_users] == [r[0] for r in base]
    assert [data.item_ids[i] for i in data.train_items] == [r[1] for r in base]
    assert data.train_ratings.tolist() == [float(r[2]) for r in base]
    assert data.cold[0] == 1 and data.test_users[-1] == 0
    assert data.titles["3"] == "Film n\xb03 (1995)"
    again = load_ratings(root, cache_dir=tmp_path / "cache")
    assert np.array_equal(again.test_items, data.test_items) and again.user_ids == data.user_ids


def test_side_features_are_read_per_index_and_feed_neural_mf(tmp_path):
    root = movielens_folder(tmp_path / "ml", low_rank_ratings(users=6, items=5, share=1.0))
    (root / "u.user").write_text("1|24|M|writer|1\n2|17|F|doctor|2\n3|60|M|writer|3\n")  # users 4-6: no row
    (root / "u.genre").write_text("Action|0\nComedy|1\nDrama|2\n\n")
    (root / "u.item").write_text("".join(f"{i}|Film {i}|01-Jan-19{80 + 5 * i}||x|{i % 2}|1|{int(i == 3)}\n"
                                         for i in range(1, 6)))
    data = load_ratings(root)
    user = {name: dict(zip(data.user_ids, codes)) for name, codes in data.side_features["user"].items()}
    assert user["gender"]["1"] == user["gender"]["3"] != user["gender"]["2"] and user["gender"]["4"] == 0
    assert user["occupation"]["1"] == user["occupation"]["3"] and len({user["age"][u] for u in "123"}) == 3
    genres = dict(zip(data.item_ids, data.side_features["item"]["genres"]))
    decade = dict(zip(data.item_ids, data.side_features["item"]["decade"]))
    assert genres["3"] == [1.0, 1.0, 1.0] and genres["2"] == [0.0, 1.0, 0.0]  # Action, Comedy, Drama (first seen)
    assert decade["2"] == decade["3"] != decade["4"] == decade["5"] and genres["<unknown>"] == [0.0] * 3
    assert "user features age, gender, occupation; item features decade, genres" in data.describe()

    args = dict(num_users=data.num_users, num_items=data.num_items, rating_range=[1.0, 5.0], required=(),
                user_features=data.side_features["user"], item_features=data.side_features["item"], factors=4)
    model = create_model("neural_mf", **args)
    assert model.mlp[0].in_features == 2 * 4 + 8 * (3 + 2)
    model.train()(torch.tensor([1, 2]), torch.tensor([3, 4])).sum().backward()
    assert model.user_side.occupation.weight.grad.abs().sum() > 0 and model.item_side.genres.weight.grad.abs().sum() > 0
    assert create_model("neural_mf", **args, side_features=False).mlp[0].in_features == 8


def test_a_csv_with_user_item_rating_columns_is_ratings_not_sentences(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n" + "1,10,4.5,0\n2,10,3.0,0\n1,11,2.0,0\n3,12,5.0,0\n" * 5)
    assert parse_spec(str(path))[0] == "ratings"
    data = load_ratings(path, val_split=0.25)
    assert len(data.train_ratings) == 15 and len(data.test_ratings) == 5 and data.rating_range == (2.0, 5.0)
    (tmp_path / "bad.csv").write_text("user,item,rating\n1,2,five\n")
    with pytest.raises(GpuaccelError, match="rating 1 is 'five', not a number"):
        load_ratings(tmp_path / "bad.csv")
    (tmp_path / "short.csv").write_text("user,item,rating\n1,2,4\n1,3\n")  # a row that lost its last field
    with pytest.raises(GpuaccelError, match="line 3 has 2 field"):
        load_ratings(tmp_path / "short.csv")
    (tmp_path / "noitem.csv").write_text("user,item,rating\n1,2,4\n1,,3\n")  # an empty id is no item
    with pytest.raises(GpuaccelError, match="rating 2 has an empty item id"):
        load_ratings(tmp_path / "noitem.csv")
    (tmp_path / "nan.csv").write_text("user,item,rating\n1,2,4\n1,3,nan\n")
    with pytest.raises(GpuaccelError, match="rating 2 is 'nan', not a finite number"):
        load_ratings(tmp_path / "nan.csv")
    (tmp_path / "u.data").write_text("1\t2\n")
    with pytest.raises(GpuaccelError, match="has 2 field"):
        load_ratings(tmp_path / "u.data")
    (tmp_path / "u.data").write_text("1\t2\t4\t881250949\n\n1\t3\t4\t881250949\t7\n")  # a fifth field
    with pytest.raises(GpuaccelError, match="line 3 has 5 field.*4 on each line"):
        load_ratings(tmp_path / "u.data")
    (tmp_path / "u.data").write_text("1\t2\t4\t881250949\n1\t3\t-3\t881250949\n")
    with pytest.raises(GpuaccelError, match="line 2 rates '-3'; MovieLens ratings are 0.5 to 5 stars"):
        load_ratings(tmp_path / "u.data")
    (tmp_path / "x.base").write_text("1\t2\t3\t0\n")
    with pytest.raises(GpuaccelError, match="no x.test beside it"):
        load_ratings(tmp_path / "x.base")


def test_unknown_users_and_items_are_predicted_from_what_is_known():
    model = create_model("matrix_factorization", num_users=5, num_items=4, rating_mean=3.5,
                         rating_range=[1.0, 5.0], required=()).eval()
    with torch.no_grad():
        model.item_bias.weight[2] = 0.7
        model.user_bias.weight[3] = 10.0
    prediction = model(torch.tensor([0, 3]), torch.tensor([2, 2]))
    assert prediction[0].item() == pytest.approx(4.2)  # unknown user: the mean and the item's bias
    assert prediction[1].item() == 5.0  # clipped to the rating range


@pytest.mark.parametrize("model", ["matrix_factorization", "neural_mf"])
def test_a_rating_model_beats_the_global_mean_and_recommends_unrated_titles(tmp_path, capsys, model):
    root = movielens_folder(tmp_path / "ml", low_rank_ratings())
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, "train", "--recipe", "movielens", "--data", str(root), "--model", model,
                         "--device", "cpu", "--epochs", "30", "--batch-size", "128", "--lr", "1e-2",
                         "--model-args", "factors=8", "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache"),
                         "--json", "--no-monitor", "--no-compile")
    assert code == 0, err
    summary = json.loads(out)
    data = load_ratings(root)
    baseline = float(np.sqrt(np.mean((data.test_ratings - data.train_ratings.mean()) ** 2)))
    assert summary["metrics"]["rmse"] < 0.85 * baseline, (summary["metrics"], baseline)
    assert summary["task"] == "regression" and summary["sample_unit"] == "ratings"

    code, out, err = run(capsys, "recommend", str(run_dir), "--user", "7", "--top", "5", "--json", "--device", "cpu")
    assert code == 0, err
    items = json.loads(out)
    rated = {data.item_ids[i] for i in data.train_items[data.train_users == data.user_ids.index("7")]}
    assert len(items) == 5 and not {i["item"] for i in items} & rated
    assert items[0]["title"].startswith("Film n\xb0") and items[0]["score"] >= items[-1]["score"]
    assert_user_error(capsys, ["recommend", str(run_dir), "--user", "12345"], "user '12345' has no ratings")


def test_autorec_reads_the_training_ratings_and_beats_the_global_mean_with_its_recipe(tmp_path, capsys):
    root = movielens_folder(tmp_path / "ml", low_rank_ratings())
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, "train", "--recipe", "movielens", "--data", str(root), "--device", "cpu",
                         "--epochs", "150", "--lr", "1e-2", "--model-args", "hidden=32,l2=1.0,mf_factors=8",
                         "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache"), "--json", "--no-monitor",
                         "--no-compile")
    assert code == 0, err
    summary = json.loads(out)
    data = load_ratings(root)
    baseline = float(np.sqrt(np.mean((data.test_ratings - data.train_ratings.mean()) ** 2)))
    assert summary["metrics"]["rmse"] < 0.85 * baseline, (summary["metrics"], baseline)
    assert summary["steps"] == 150  # one batch of every training rating per epoch
    # the saved model carries the ratings it decodes from: rebuilt from model.pt alone it predicts the same
    from gpuaccel.deploy.artifact import load_run_state, rebuild_model

    model = rebuild_model(*load_run_state(run_dir)).eval()
    assert model.ratings[torch.from_numpy(data.train_items), torch.from_numpy(data.train_users)].tolist() == \
        data.train_ratings.tolist()
    code, out, err = run(capsys, "recommend", str(run_dir), "--user", "7", "--top", "3", "--json", "--device", "cpu")
    assert code == 0 and len(json.loads(out)) == 3, err


def test_autorec_members_are_fitted_on_their_own_and_unknown_items_fall_back_to_the_factorization():
    from gpuaccel.tasks import Regression
    from gpuaccel.train.config import TrainConfig
    from gpuaccel.train.optim import build_optimizer

    model = create_model("autorec", num_users=5, num_items=4, rating_mean=3.0, rating_range=[1.0, 5.0],
                         required=(), hidden=3, mf_factors=2)
    model.data_init(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2]), torch.tensor([4.0, 2.0, 5.0]))
    assert model.ratings.sum().item() == 11.0 and model.count.item() == 3
    users, items, ratings = torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2]), torch.tensor([4.0, 2.0, 5.0])
    both = model.train()(users, items)
    assert both.shape == (3, 2)
    # the loss is the mean of the members' own losses: neither member's gradient involves the other
    loss = Regression().loss(both, ratings)
    assert loss.item() == pytest.approx(((both - ratings[:, None]) ** 2).mean().item())
    loss.backward()
    alone = model.factorization(users, items)
    grads = torch.autograd.grad(0.5 * ((alone - ratings) ** 2).mean(), model.factorization.item_bias.weight)[0]
    assert torch.allclose(grads, model.factorization.item_bias.weight.grad)
    # the factorisation member learns at ten times the rate
    rates = {id(p): g["lr"] for g in build_optimizer(model, TrainConfig(lr=1e-3).optimizer).param_groups
             for p in g["params"]}
    assert rates[id(model.factorization.user_factors.weight)] == pytest.approx(1e-2)
    assert rates[id(model.encode.weight)] == pytest.approx(1e-3)
    model.eval()
    with torch.no_grad():
        prediction = model(torch.tensor([1, 1]), torch.tensor([0, 3]))  # an unknown item, a known one
        factorized = model.factorization(torch.tensor([1, 1]), torch.tensor([0, 3])).clamp(1, 5)
    assert prediction[0].item() == pytest.approx(factorized[0].item())
    assert prediction[1].item() != pytest.approx(factorized[1].item())
    with pytest.raises(GpuaccelError, match="for task ranking"):
        create_model("autorec", num_users=5, num_items=4, rating_range=None, required=())


# ------------------------------------------------------------------------------ top-k from implicit feedback

def test_leave_one_out_holds_out_each_users_latest_item_against_unseen_negatives(tmp_path):
    root = tmp_path / "ml"
    root.mkdir()
    rows = [(1, 10, 5, 300), (1, 11, 3, 100), (1, 12, 4, 200), (2, 10, 4, 50), (2, 13, 2, 60), (3, 11, 1, 10)]
    rows += [(8, item, 3, 0) for item in range(21, 40)]  # items enough to draw negatives from
    rows += [(9, item, 3, 0) for item in range(14, 21)]  # one timestamp: the file's order decides
    (root / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    data = load_interactions(root, negatives=5, seed=1)
    held = {data.user_ids[u]: data.item_ids[row[0]] for u, row in zip(data.test_users, data.test_items)}
    assert held == {"1": "10", "2": "13", "8": "39", "9": "20"}  # user 3 has one interaction: it stays in training
    for u, row in zip(data.test_users, data.test_items):
        interacted = {data.item_ids[i] for i in data.train_items[data.train_users == u]} | {data.item_ids[row[0]]}
        negatives = [data.item_ids[i] for i in row[1:]]
        assert len(set(negatives)) == 5 and not set(negatives) & interacted
    assert np.array_equal(load_interactions(root, negatives=5, seed=1).test_items, data.test_items)


def test_sampled_negatives_that_are_interactions_are_labelled_positive():
    users, items = np.array([1, 1, 2]), np.array([1, 2, 1])
    cpu = torch.device("cpu")
    loader = ResidentLoader(NegativeSamples(users, items, num_items=3, negatives=50, device=cpu), batch_size=1000,
                            device=cpu, train=True)
    u, i, labels = next(loader.batches(0))
    assert len(labels) == 3 * 51
    resumed = list(loader.batches(1, start=0))[0]  # (the same samples again for the same epoch: a resume's)
    assert all(torch.equal(a, b) for a, b in zip(resumed, next(loader.batches(1))))
    assert not torch.equal(resumed[1], i) or not torch.equal(resumed[0], u)  # (drawn again each epoch)
    interacted = {(1, 1), (1, 2), (2, 1)}
    assert all(bool(y) == ((int(a), int(b)) in interacted) for a, b, y in zip(u, i, labels))
    assert 0 < labels.mean() < 1  # both kinds drawn


def test_hit_rate_and_ndcg_count_the_held_out_items_position():
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.1, 0.5, 0.9], [0.5, 0.5, 0.1]])
    targets = torch.zeros(3, dtype=torch.long)
    task = Ranking(k=2)
    metrics = task.metrics()
    hits = metrics["hr@2"].finish(metrics["hr@2"].sums(scores, targets).tolist())
    ndcg = metrics["ndcg@2"].finish(metrics["ndcg@2"].sums(scores, targets).tolist())
    # positions: first; third (missed); tied with one other (counted as second)
    assert hits == pytest.approx(2 / 3) and ndcg == pytest.approx((1 + 1 / np.log2(3)) / 3)


def taste_interactions(users=60, items=60, per_user=15, seed=0):
    """Each user rates the items that best fit a rank-2 taste (which items, not how: implicit
    feedback), at random times."""
    rng = np.random.default_rng(seed)
    taste, traits = rng.normal(0, 1, (users, 2)), rng.normal(0, 1, (items, 2))
    rows = []
    for u in range(users):
        fit = taste[u] @ traits.T + 0.3 * rng.standard_normal(items)
        for i in np.argsort(-fit)[:per_user]:
            rows.append((u + 1, int(i) + 1, 4, int(rng.integers(0, 10 ** 6))))
    return rows


def test_a_ranking_run_beats_chance_and_recommends(tmp_path, capsys):
    root = movielens_folder(tmp_path / "ml", taste_interactions())
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, "train", "--recipe", "movielens-topk", "--data", str(root), "--device", "cpu",
                         "--no-compile", "--epochs", "15", "--batch-size", "256", "--lr", "1e-2", "--eval-negatives",
                         "19", "--model-args", "factors=8", "--run-dir", str(run_dir), "--json", "--no-monitor",
                         "--cache-dir", str(tmp_path / "cache"))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["task"] == "ranking" and summary["metrics"]["hr@10"] > 0.5 + 0.1  # chance: 10 of 20 = 0.5
    code, out, err = run(capsys, "recommend", str(run_dir), "--user", "3", "--top", "3", "--json", "--device", "cpu")
    assert code == 0, err
    assert len(json.loads(out)) == 3


# ------------------------------------------------------------------------------ DLRM with tables updated in the backward pass

@pytest.mark.parametrize("sizes", [(5, 7), (3, 7)])
def test_fused_tables_take_row_wise_adagrad_steps_with_duplicates_summed(sizes):
    """Every table updated row by row (5 and 7 rows, 3 ids each), or the first one whole (3 rows
    for 3 ids: each row once, the one without gradient as it was): the same Adagrad step."""
    from gpuaccel.models.dlrm import FusedEmbeddingTables

    torch.manual_seed(0)
    tables = FusedEmbeddingTables(list(sizes), 4, lr=0.1)
    before = tables.weight.detach().clone()
    ids = torch.tensor([[1, 2], [1, 6], [0, 2]])  # row 1 of table 0 and row 2 of table 1 twice
    target = torch.randn(3, 2, 4)
    ((tables(ids) - target) ** 2).sum().backward()
    whole, by_row = tables._update_plan(ids)
    assert (whole is not None) == (sizes[0] == 3) and by_row.tolist() == ([0, 1] if sizes[0] == 5 else [1])
    dense = before.clone().requires_grad_(True)
    ((dense[ids + torch.tensor([0, sizes[0]])] - target) ** 2).sum().backward()
    used = dense.grad.abs().sum(1) > 0
    accumulated = dense.grad.square().mean(1) * used
    expected = before - 0.1 * dense.grad / (accumulated.sqrt() + 1e-8).unsqueeze(1)
    assert torch.allclose(tables.weight.detach(), expected, atol=1e-6)
    assert torch.allclose(tables.accumulator, accumulated) and tables.weight.grad is None


def test_a_dlrm_learns_clicks_through_the_trainer_with_its_tables_left_to_itself(tmp_path):
    from plain_models import click_task, clicks

    import gpuaccel
    from gpuaccel.train.optim import build_optimizer

    dense, sparse, labels = clicks()
    model = create_model("dlrm", table_sizes=[50, 30, 20], dim=8, bottom=[16], top=[32], table_lr=0.1, required=())
    config = gpuaccel.TrainConfig(batch_size=256, epochs=20, optimizer="adamw", lr=3e-3, weight_decay=0.0,
                                  device="cpu", monitor=False, run_dir=str(tmp_path / "run"))
    trainer = gpuaccel.Trainer(config, model=model, train_data=(dense[:3584], sparse[:3584], labels[:3584]),
                               eval_data=(dense[3584:], sparse[3584:], labels[3584:]), task=click_task(), quiet=True)
    table = trainer.model.tables.weight
    assert all(table is not p for group in build_optimizer(trainer.model, config.optimizer).param_groups
               for p in group["params"])
    before = table.detach().clone()
    summary = trainer.fit()
    assert not torch.equal(before, table.detach()) and trainer.model.tables.accumulator.sum() > 0
    assert summary["metrics"]["accuracy"] > 0.9, summary["metrics"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_move_as_words_where_their_layout_allows(device):
    """DLRM's index kernels move rows as 8-byte words: the same bits (written back with duplicated
    rows, cleared, gathered from a strided view), and rows whose layout does not allow it (or
    integer ids) stay as they are."""
    from gpuaccel.models.dlrm import _as_words

    torch.manual_seed(0)
    table = torch.randn(1000, 128, device=device)
    rows = torch.randint(0, 1000, (4000,), device=device)  # duplicates: each writes its row's one value
    new = torch.randn(4000, 128, device=device)[torch.unique(rows, return_inverse=True)[1]]
    plain, words = table.clone(), table.clone()
    plain.index_put_((rows,), new)
    _as_words(words).index_put_((rows,), _as_words(new))
    assert torch.equal(plain.view(torch.int32), words.view(torch.int32))
    plain.index_fill_(0, rows, 0.0)
    _as_words(words).index_fill_(0, rows, 0)
    assert torch.equal(plain.view(torch.int32), words.view(torch.int32))
    interaction = torch.randn(64, 27, 128, device=device).to(torch.bfloat16)
    gradient = interaction[:, 1:]  # the tables' part of the interaction's gradient: a strided view
    assert _as_words(gradient).dtype == torch.int64 and _as_words(gradient).shape == (64, 26, 32)
    order = torch.tensor([3, 0, 25], device=device)
    gathered = _as_words(gradient).transpose(0, 1)[order].view(torch.bfloat16)
    assert torch.equal(gathered.view(torch.int16), gradient.transpose(0, 1)[order].view(torch.int16))
    for unchanged in (interaction[:, :, 1:], torch.zeros(4, 26, dtype=torch.int64), torch.randn(8)):
        assert _as_words(unchanged) is unchanged


def test_exchange_chunks_below_one_are_refused():
    from gpuaccel.models.dlrm import FusedEmbeddingTables

    with pytest.raises(GpuaccelError, match="exchange_chunks must be 1 or more, not 0"):
        FusedEmbeddingTables([5, 7], 4, exchange_chunks=0)


def test_exchange_chunks_are_four_with_tables_sharded_over_four_or_more_processes_unless_given():
    from gpuaccel.models.dlrm import FusedEmbeddingTables

    chosen, given = FusedEmbeddingTables([5, 7], 4), FusedEmbeddingTables([5, 7], 4, exchange_chunks=2)
    for world, records, expected, expected_given in ((1, 16, 1, 2), (2, 16, 1, 2), (4, 16, 4, 2), (8, 16, 4, 2),
                                                      (4, 18, 1, 2), (4, 15, 1, 1)):
        chosen.shard_world = given.shard_world = world
        assert (chosen._chunks(records), given._chunks(records)) == (expected, expected_given), (world, records)
