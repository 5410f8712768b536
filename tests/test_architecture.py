"""The package's layers: no subpackage imports one that imports it back (even inside a function);
the runtime below both doors; and the Trainer's attributes few and assigned by its loop only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpuaccel

ROOT = Path(gpuaccel.__file__).parent


def _imported_parts(path: Path) -> set[str]:
    """The gpuaccel subpackages (or top-level modules) a file imports, anywhere in it."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    package = parts[:-1] if path.name != "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            names = [target] if len(target) > 1 else [target + [alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found |= {n[1] for n in names if n[0] == "gpuaccel" and len(n) > 1}
    return found


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether ``goal`` is reachable from ``start`` along the graph's edges."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_import_cycles_between_parts():
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package's front door imports the parts it offers
        part = parts[0]
        graph.setdefault(part, set()).update(_imported_parts(path) - {part})

    cycles = sorted((a, b) for a, deps in graph.items() for b in deps if _reaches(graph, b, a))
    assert not cycles, f"import cycles between parts: {cycles}"
    assert "train" not in graph["deploy"] or "deploy" not in graph["train"]
    assert {"train", "deploy", "bench"}.isdisjoint(graph["tasks"] | graph["models"] | graph["data"])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the gpuaccel modules it imports, anywhere in it (a package's import is its
    ``__init__``; ``from . import name`` of a submodule is that submodule)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - (node.level - 1)] if node.level else []
                target = base + (node.module.split(".") if node.module else [])
                targets = [".".join(target + [a.name]) for a in node.names]
                targets = [t if t in modules else ".".join(target) for t in targets]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("gpuaccel") and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def test_no_two_modules_import_each_other_even_through_others():
    graph = _module_graph()

    assert len(graph) > 90 and "gpuaccel.deploy.bench" in graph["gpuaccel.cli.deploy"]  # (the walk finds them)
    cycles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if _reaches(graph, b, a)})
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_runtime_is_below_both_doors():
    """Trainer and Accelerator share one runtime; it knows neither, nor the CLI."""
    graph = _module_graph()
    runtime = {m for m in graph if m.startswith("gpuaccel.runtime")}
    assert runtime and all(not {d for d in graph[m] if d.startswith(("gpuaccel.train", "gpuaccel.accelerator",
                                                                      "gpuaccel.cli"))} for m in runtime)
    assert "gpuaccel.accelerator" in graph["gpuaccel.train.trainer"]
    assert {"gpuaccel.runtime", "gpuaccel.runtime.capture"} & graph["gpuaccel.train.trainer"]


LOOP_MODULES = {"train/trainer.py", "train/fit_context.py"}  # the Trainer's loop and its fit's context


def test_only_the_loop_assigns_the_trainers_attributes():
    """A module that reads a trainer (``trainer.x``) may call its parts, but only the loop's own
    modules assign ``trainer.x = ...`` (or ``trainer.x.y = ...``): the rest return what they made."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in LOOP_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for part in ast.walk(target):
                    base = part
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(part, ast.Attribute) and isinstance(base, ast.Name) and base.id == "trainer":
                        offenders.append(f"{name}:{node.lineno}")
    assert not offenders, offenders


def test_a_trained_trainer_holds_few_attributes(tmp_path):
    """What the accelerator and the strategy decided is read from them, not copied into the Trainer."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(64, 4)
    trainer = gpuaccel.Trainer(gpuaccel.TrainConfig(batch_size=32, epochs=1, device="cpu", ema=0.9, monitor=False,
                                                    run_dir=str(tmp_path / "run")),
                               model=torch.nn.Linear(4, 2), train_data=(x, (x[:, 0] > 0).long()),
                               eval_data=(x[:32], (x[:32, 0] > 0).long()), loss_fn=F.cross_entropy, quiet=True)
    trainer.fit()
    assert len(vars(trainer)) <= 25, sorted(vars(trainer))


def _settings_reads(monkeypatch) -> list[tuple[str, frozenset]]:
    """Records each read of the settings (TrainConfig, its sections, the kinds' option groups) from
    gpuaccel's code outside the settings' own declaring and validating: (the reading file, the
    gpuaccel files on the call stack then)."""
    import dataclasses
    import importlib
    import pkgutil
    import sys

    import gpuaccel.kinds
    from gpuaccel.train import config as config_module

    modules = [config_module] + [importlib.import_module(f"gpuaccel.kinds.{m.name}")
                                 for m in pkgutil.iter_modules(gpuaccel.kinds.__path__)]
    sections = {c for m in modules for c in vars(m).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
                and c.__module__ == m.__name__ and c is not config_module.Setting} | {config_module.TrainConfig}
    reads, root = [], str(ROOT) + "/"
    own = {config_module.__file__, str(ROOT / "settings.py")}  # (the settings' own modules: declaring, validating)

    def watched(cls):
        original = cls.__getattribute__

        def read(self, name):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(root) and frame.f_code.co_filename not in own \
                    and not name.startswith("__"):
                stack, validating = set(), False
                while frame is not None:
                    if frame.f_code.co_filename.startswith(root):
                        stack.add(frame.f_code.co_filename[len(root):])
                    # (a kind's option group checking its values is the settings' own validation)
                    validating |= frame.f_code.co_filename == config_module.__file__ and \
                        frame.f_code.co_name == "validate"
                    frame = frame.f_back
                if not validating:
                    reads.append((sys._getframe(1).f_code.co_filename[len(root):], frozenset(stack)))
            return original(self, name)
        return read

    for cls in sections:
        monkeypatch.setattr(cls, "__getattribute__", watched(cls))
    return reads


def _returns(reads) -> dict[str, int]:
    """Files that read the settings again after they had left the call stack (a caller resuming
    after its callee returned has not left it)."""
    returns, last_seen = {}, {}
    for k, (file, _) in enumerate(reads):
        if file in last_seen and any(file not in stack for _, stack in reads[last_seen[file] + 1:k]):
            returns[file] = returns.get(file, 0) + 1
        last_seen[file] = k
    return returns


@pytest.mark.parametrize("data, model", [("digits", "mlp"), ("TEXT", "gpt")])
def test_following_the_settings_from_trainer_goes_down_the_layers(monkeypatch, tmp_path, data, model):
    """While ``Trainer(...)`` builds a run, each file that reads the settings does so in one visit,
    except the data kind's (it opens the data, and later, asked by the loop once device, precision
    and ranks are decided, builds its loaders): no if-chain over data kinds sends the path back up."""
    if data == "TEXT":
        data = str(tmp_path / "text.txt")
        (tmp_path / "text.txt").write_text("to be or not to be, that is the question\n" * 200)
    reads = _settings_reads(monkeypatch)
    gpuaccel.Trainer(gpuaccel.TrainConfig(data=data, model=model, device="cpu", epochs=1, batch_size=32,
                                          monitor=False, compile=False, run_dir=str(tmp_path / "run")), quiet=True)
    files = {file for file, _ in reads}
    kind = {"mlp": "kinds/images.py", "gpt": "kinds/corpus.py"}[model]
    assert {"train/trainer.py", "train/inputs.py", kind, "runtime/strategy.py", "train/optim.py"} <= files
    assert _returns(reads) == {kind: 1}, _returns(reads)
