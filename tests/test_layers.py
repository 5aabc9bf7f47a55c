"""The package's layers (docs/contributing.md): every import of a fedfew module, at the top of a file or
inside a function, goes to the importer's own layer or a layer below it, and no module imports a
command (the top-level modules people type)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fedfew"
#: what people type: ``python -m fedfew.<name>``; each parses its arguments and calls the layers
COMMANDS = {"train", "check", "tune", "compare", "runs", "notebook", "bench", "flower"}
#: bottom to top; a module may import from its own layer and the ones listed before it
LAYERS = [
    {"core", "stch", "data", "models"},   # what everything is built from
    {"engines", "algorithms"},            # how clients train; one file per method
    {"simulator", "config"},              # the round loop and evaluation; run configuration
    {"reporting"},                        # what a run writes and shows
    {"experiments"},                      # many runs: tuning, comparison, run lists
    {"flower", "bench"},                  # other ways to run the same algorithms; benchmarks
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, fedfew module) of every import in the file, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fedfew":
                found += [(node.lineno, f"fedfew.{a.name}") for a in node.names]
            elif node.module.startswith("fedfew."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("fedfew.")]
    return found


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert subpackages - COMMANDS <= set(RANK), f"give {sorted(subpackages - COMMANDS - set(RANK))} a layer in LAYERS"
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top <= COMMANDS, f"top-level modules are commands only; move {sorted(top - COMMANDS)} into a layer"


def test_imports_go_down_the_layers_and_never_to_a_command():
    wrong = []
    for path, parts in _modules():
        mine = parts[0]
        for line, target in _imports(path):
            theirs = target.split(".")[1]
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if theirs in COMMANDS and theirs != mine and theirs not in RANK:
                wrong.append(f"{where} (a command: move what it needs into a layer)")
            elif mine in RANK and theirs in RANK and RANK[theirs] > RANK[mine]:
                wrong.append(f"{where} (layer {RANK[theirs]} above {mine}'s {RANK[mine]})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    """The walker finds an upward import hidden in a function (the check can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fedfew.experiments.tuning import Plan\n    import fedfew.train\n")
    assert _imports(module) == [(2, "fedfew.experiments.tuning"), (3, "fedfew.train")]


def test_one_key_table_decides_run_identity_presets_and_resume():
    """Run folders, presets and resume read fedfew.core.keys: a key's three roles, by hand."""
    from fedfew.config.presets import setup_changing
    from fedfew.core.checkpoint import _free
    from fedfew.core.keys import role
    from fedfew.core.run_folders import result_overrides, run_suffix

    assert role("trainer.threads").key == "trainer.threads" and role("trainer.precision").key == "trainer"
    assert role("algorithm.K") is None
    extra = ["trainer.threads=1", "trainer.precision=bf16-mixed", "algorithm.K=5", "data_dir=/d", "engine=vmap"]
    assert result_overrides(extra) == ["trainer.precision=bf16-mixed", "algorithm.K=5", "engine=vmap"]
    assert setup_changing(extra) == ["algorithm.K=5"]
    assert [k for k in ("trainer.threads", "trainer.devices", "trainer.precision", "data_dir", "optim.lr") if _free(k)] \
        == ["trainer.threads", "trainer.devices", "data_dir"]
    assert run_suffix(["dataset=agnews", "algorithm.K=5", "logger=wandb", "hydra.verbose=true"]) == "_K-5"
