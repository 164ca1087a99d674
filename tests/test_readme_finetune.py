"""The fine-tuning walk-through (docs/FINETUNING.md, linked from the README) runs as written: make a random
Hugging Face Llama, SFT it on chat JSONL streamed through the sim device under a budget smaller than its weights,
export, load in transformers and generate, everything under out/. The default suite runs it with 2 steps;
`make test-slow` runs it exactly as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def walkthrough() -> str:
    text = (REPO / "docs" / "FINETUNING.md").read_text()
    block = re.search(r"<!-- finetune -->\s*```bash\n(.*?)```\s*<!-- /finetune -->", text, re.S)
    assert block, "docs/FINETUNING.md lost its fine-tuning block"
    return block.group(1)


def _run(tmp_path, script: str) -> str:
    bindir = Path(sys.executable).parent
    lines = [line for line in script.splitlines() if not line.startswith("make hf")]  # the venv has the extras
    script = "\n".join(lines).replace(".venv/bin/", f"{bindir}/").replace("examples/", f"{REPO}/examples/")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "MEGATRAIN_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _check(tmp_path, out: str, steps: int) -> None:
    weights = (tmp_path / "out" / "tiny-llama" / "model.safetensors").stat().st_size
    budget = re.search(r"streamed through a sim device with a (\d+) MiB budget", out)
    assert budget and int(budget.group(1)) * 2**20 < weights, out  # the weights do not fit: they stream
    assert f"checkpoint: out/sft-ck/step-{steps:08d}" in out
    assert sorted(p.name for p in (tmp_path / "out" / "tiny-llama-sft").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert "What does os.path.join do?\n-> " in out


def test_readme_finetune_walkthrough_with_two_steps(tmp_path):
    script = walkthrough()
    for flag, value in (("--steps", 2), ("--checkpoint-every", 2), ("--eval-every", 1)):
        script, n = re.subn(rf"{flag} \d+", f"{flag} {value}", script)
        assert n == 1, flag
    _check(tmp_path, _run(tmp_path, script), steps=2)


@pytest.mark.slow
def test_readme_finetune_walkthrough_as_written(tmp_path):
    script = walkthrough()
    out = _run(tmp_path, script)
    _check(tmp_path, out, steps=int(re.search(r"--steps (\d+)", script).group(1)))
