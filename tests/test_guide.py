"""docs/guide.md stays true: every `path::symbol` it cites exists, every file it names exists,
every command it gives runs on the CPU, and the online-softmax maths it states is checked against
a plain softmax. A command that runs CPU tests (`python -m pytest tests/x.py::name`) is checked
for naming existing tests that are not `gpu`-marked: this suite runs them itself, so running them
again in a subprocess would only double its time. GPU-only commands are checked for the tests
they name."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guide.md").read_text()
REFERENCE = re.compile(r"`([\w/.\-]+\.(?:py|cu|cuh))::([\w.]+)`")
PATH = re.compile(r"`((?:tinyvllm|cuda|tests|docs|benchmarks)/[\w/.\-]+\.(?:py|cu|cuh|md))`")
COMMAND = re.compile(r"^Run( \(GPU\))?: `(.+)`\s*$", re.M)
TEST_NODE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")
MODEL_DIR = "/tmp/tiny"


def _python_symbols(path: Path, symbol: str) -> bool:
    """Does `symbol` (A or A.B, ...) name a def, class, assignment or annotated field?"""
    body = ast.parse(path.read_text()).body
    for part in symbol.split("."):
        found = None
        for node in body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if part in names:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


REFERENCES = sorted(set(REFERENCE.findall(GUIDE)))
COMMANDS = [(bool(gpu), cmd) for gpu, cmd in COMMAND.findall(GUIDE)]


def test_the_guide_cites_code_and_gives_commands():
    assert len(REFERENCES) > 50 and len(COMMANDS) > 25
    assert COMMANDS[0] == (False, f"python -m tinyvllm make-model {MODEL_DIR} --preset tiny")


@pytest.mark.parametrize("path,symbol", REFERENCES, ids=[f"{p}::{s}" for p, s in REFERENCES])
def test_reference_exists(path, symbol):
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    if path.endswith(".py"):
        assert _python_symbols(file, symbol), f"{path} has no {symbol}"
    else:
        assert re.search(rf"\b{re.escape(symbol)}\b", file.read_text()), f"{path} never mentions {symbol}"


def test_named_files_exist():
    missing = [p for p in set(PATH.findall(GUIDE)) if not (ROOT / p).is_file()]
    assert not missing, missing


def _gpu_marked(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    if any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n) and "gpu" in ast.unparse(n.value)
           for n in tree.body):
        return True
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    return fn is not None and any("mark.gpu" in ast.unparse(d) for d in fn.decorator_list)


@pytest.mark.parametrize("gpu,command", COMMANDS)
def test_named_tests_exist(gpu, command):
    for path, name in TEST_NODE.findall(command):
        assert (ROOT / path).is_file(), path
        assert not name or _python_symbols(ROOT / path, name), f"{path} has no {name}"
        if not gpu:
            assert not _gpu_marked(ROOT / path, name), f"{path}::{name} is gpu-marked: mark the command (GPU)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The guide's own first command, writing the tiny model to a temporary directory."""
    out = tmp_path_factory.mktemp("guide") / "tiny"
    _run(COMMANDS[0][1], out)
    return out


def _run(command: str, model_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shell = command.replace(MODEL_DIR, str(model_dir))
    shell = re.sub(r"(^|\| *)python ", lambda m: f"{m.group(1)}{sys.executable} ", shell)
    r = subprocess.run(["bash", "-c", shell], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, f"{command}\n-> exit {r.returncode}\n{out[-3000:]}"
    return r


CPU_COMMANDS = [cmd for gpu, cmd in COMMANDS[1:] if not gpu and " -m pytest " not in cmd]


@pytest.mark.parametrize("command", CPU_COMMANDS, ids=[c[:60] for c in CPU_COMMANDS])
def test_command_runs_on_the_cpu(command, model_dir):
    _run(command, model_dir)


# -- the maths of section 19, as stated there ------------------------------------------------------

def _softmax_attention(s, v):
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


def test_online_softmax_rescaling_equals_softmax():
    rng = np.random.default_rng(0)
    s, v = rng.standard_normal(1000) * 5, rng.standard_normal((1000, 8))
    m, ell, o = -np.inf, 0.0, np.zeros(8)   # ell: the guide's running sum l
    for chunk in range(0, 1000, 64):
        sc, vc = s[chunk:chunk + 64], v[chunk:chunk + 64]
        m_new = max(m, sc.max())
        alpha = np.exp(m - m_new)                     # 0 on the first chunk
        e = np.exp(sc - m_new)
        ell, o, m = alpha * ell + e.sum(), alpha * o + e @ vc, m_new
    np.testing.assert_allclose(o / ell, _softmax_attention(s, v), rtol=1e-12)


def test_split_merge_equals_softmax():
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal(999) * 5, rng.standard_normal((999, 8))
    parts = []
    for split in np.array_split(np.arange(999), 7):          # each split: its own (m, l, o)
        m = s[split].max()
        e = np.exp(s[split] - m)
        parts.append((m, e.sum(), e @ v[split]))
    big_m = max(p[0] for p in parts)
    out = sum(np.exp(m - big_m) * o for m, _, o in parts) / sum(np.exp(m - big_m) * ell for m, ell, _ in parts)
    np.testing.assert_allclose(out, _softmax_attention(s, v), rtol=1e-12)


def test_split_merge_in_base_2_and_log_sum_exp_form():
    """Section 21's merge as the decode kernel does it (scores in base 2, a split without tokens
    has m = -inf and weight 0) and in its log-sum-exp form, both against a plain softmax."""
    rng = np.random.default_rng(2)
    s, v = rng.standard_normal(700) * 5, rng.standard_normal((700, 8))
    log2e = 1 / np.log(2)
    bounds = [0, 0, 90, 91, 400, 700, 700]          # splits 0 and 5 are empty
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            parts.append((-np.inf, 0.0, np.zeros(8)))
            continue
        t = s[lo:hi] * log2e                        # the kernel's base-2 scores
        m = t.max()
        e = np.exp2(t - m)
        parts.append((m, e.sum(), e @ v[lo:hi]))
    big_m = max(m for m, _, _ in parts)
    w = np.array([0.0 if m == -np.inf else np.exp2(m - big_m) for m, _, _ in parts])
    den = sum(wi * ell for wi, (_, ell, _) in zip(w, parts))
    out = sum(wi / den * o for wi, (_, _, o) in zip(w, parts))
    np.testing.assert_allclose(out, _softmax_attention(s, v), rtol=1e-12)
    # log-sum-exp form: each split's normalised output, weighted by exp(lse_s - lse)
    full = [(m / log2e + np.log(ell), o / ell) for m, ell, o in parts if ell > 0]
    lse = np.logaddexp.reduce([x for x, _ in full])
    np.testing.assert_allclose(sum(np.exp(x - lse) * o for x, o in full), _softmax_attention(s, v), rtol=1e-12)
