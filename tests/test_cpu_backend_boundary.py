"""The CPU backend stays behind its boundary: off, or on a device other than the CPU (Metal), a model
loads and generates without `akunu.backends.cpu` ever being imported, and the model is mlx-lm's own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Loads a tiny GGUF, generates a few tokens speculatively, and reports what a user of the model sees.
GENERATE = """
from pathlib import Path

import mlx_lm.models.base as mlx_base
from mlx_lm.models import activations

from akunu import backends, cost_curve
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models import load_model
from tests.tiny_gguf import write_tiny_gguf

path = Path(sys.argv[1]) / "tiny.gguf"
write_tiny_gguf(path)
loaded = load_model(str(path), dtype="float32")
prompt = loaded.tokenizer.encode("hello hello hello")
config = GenerationConfig(max_tokens=6, spec=SpecConfig(draft_tokens=3, draft_length="fixed"))
_, ids, _ = generate(loaded.model, loaded.tokenizer, prompt, config)
assert len(ids) == 6, ids
module = sys.modules[type(loaded.model).__module__]
classes = {type(m).__module__ for _, m in loaded.model.named_modules()}
print("classes mlx's", all(name.startswith(("mlx_lm.", "mlx.nn.")) for name in classes), sorted(classes))
print("attention mlx-lm's", module.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention)
print("swiglu mlx-lm's", getattr(module, "swiglu", activations.swiglu) is activations.swiglu)
print("key", cost_curve.curve_key("tiny", "float32"))
print("describe", backends.describe())
print("cpu imported", "akunu.backends.cpu" in sys.modules)
"""

# macOS with Metal: nothing to preload at import, and the device check answers "not the CPU".
PRETEND_METAL = """
import sys

real_platform, sys.platform = sys.platform, "darwin"
import akunu.backends

sys.platform = real_platform
akunu.backends.on_cpu = lambda: False
"""


def run(code: str, tmp_path: Path, **env: str) -> str:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    script = "import sys\n" + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


MLX_LM_MODEL = ["classes mlx's True", "attention mlx-lm's True", "swiglu mlx-lm's True"]


@pytest.mark.parametrize("switch", ["0", "off"])
def test_with_the_backend_off_the_cpu_package_is_never_imported_and_the_model_is_mlx_lms(tmp_path, switch):
    out = run(GENERATE, tmp_path, AKUNU_CPU_BACKEND=switch)
    assert "cpu imported False" in out
    assert all(fact in out for fact in MLX_LM_MODEL), out
    assert "key tiny-float32-cpu-mlx" in out  # not a curve measured with the backend's step
    assert "akunu's CPU backend is off" in out


def test_on_a_device_other_than_the_cpu_the_cpu_package_is_never_imported(tmp_path):
    out = run(PRETEND_METAL + GENERATE, tmp_path)
    assert "cpu imported False" in out
    assert all(fact in out for fact in MLX_LM_MODEL), out
    assert "key tiny-float32-gpu-mlx" in out


def test_on_the_cpu_the_backend_is_applied(tmp_path):
    """The control: the same script with the backend on sees it imported and mlx-lm's model patched."""
    out = run(GENERATE, tmp_path, AKUNU_CPU_BACKEND="1")
    assert "cpu imported True" in out
    assert not any(fact in out for fact in MLX_LM_MODEL), out
    assert "key tiny-float32-cpu-openblas" in out or "key tiny-float32-cpu-reference" in out
