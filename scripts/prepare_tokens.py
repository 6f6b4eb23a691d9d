"""Write a tokenized corpus for ``dataset=tokens``: ``train.bin``, ``val.bin`` and ``meta.json``.

    python scripts/prepare_tokens.py <text files or folders> --out data/tokens [--tokenizer bytes]

Reads every file given, and every file under each folder given (``--glob``, default ``*.txt``), in sorted
order, as UTF-8 text; the last ``--val-fraction`` of the files' bytes (by whole files when there are at
least 10 files, else by bytes) is the validation split. Tokens are written as flat arrays of ``uint16`` ids
(nanoGPT's layout; ``uint32`` when the vocabulary needs it) with ``meta.json`` giving ``vocab_size``,
``dtype``, ``tokenizer`` and the token counts.

Tokenizers: ``bytes`` (the default: one token per UTF-8 byte, vocabulary 256, nothing to install), or
``tiktoken:<encoding>`` (e.g. ``tiktoken:gpt2``, vocabulary 50257) when the ``tiktoken`` package is installed
and its encoding files are already in its cache: this script downloads nothing, and tiktoken would try to
fetch a missing encoding, so the run is refused unless ``TIKTOKEN_CACHE_DIR`` holds it. Output files are
written to a temporary name and renamed, so a failed run leaves no half-written corpus.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _env import require_project_python  # noqa: E402 - standard library only; scripts/ is on sys.path

require_project_python()  # a shell without .venv activated: one error: line naming the fix

import numpy as np  # noqa: E402


def _files(inputs: list[str], pattern: str) -> list[Path]:
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob(pattern) if p.is_file()))
        elif path.is_file():
            found.append(path)
        else:
            raise SystemExit(
                f"error: {item} is neither a file nor a folder: give text files or folders of them"
            )
    if not found:
        raise SystemExit(
            f"error: no files matching {pattern} in {', '.join(inputs)}: pass --glob '*.py' or files"
        )
    return found


def _tokenizer(name: str):
    """``(encode: str -> list[int], vocab_size)``."""
    if name == "bytes":
        return (lambda text: list(text.encode("utf-8"))), 256
    if name.startswith("tiktoken:"):
        try:
            import tiktoken
        except ImportError:
            raise SystemExit(
                "error: --tokenizer tiktoken:... needs the tiktoken package: pip install tiktoken"
            ) from None
        if not os.environ.get("TIKTOKEN_CACHE_DIR"):
            raise SystemExit(
                "error: tiktoken downloads encodings it has not cached; set TIKTOKEN_CACHE_DIR to a folder "
                "that "
                "holds the encoding's files, or use --tokenizer bytes"
            )
        encoding = tiktoken.get_encoding(name.split(":", 1)[1])
        return (lambda text: encoding.encode_ordinary(text)), int(encoding.n_vocab)
    raise SystemExit(f"error: unknown tokenizer {name!r}: use bytes or tiktoken:<encoding>")


def _write(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tokens.tofile(tmp)
    os.replace(tmp, path)


def prepare(inputs: list[str], out: Path, tokenizer: str = "bytes", val_fraction: float = 0.1,
            pattern: str = "*.txt") -> dict:  # fmt: skip
    """Tokenize ``inputs`` into ``out``; returns the ``meta.json`` it wrote."""
    if not 0.0 < val_fraction < 1.0:
        raise SystemExit(f"error: --val-fraction must be in (0, 1), got {val_fraction}")
    files = _files(inputs, pattern)
    encode, vocab_size = _tokenizer(tokenizer)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    if len(files) >= 10:  # whole files: no validation text inside a training file
        n_val = max(1, round(val_fraction * len(files)))
        train_text, val_text = "".join(texts[:-n_val]), "".join(texts[-n_val:])
    else:
        joined = "".join(texts)
        cut = int(len(joined) * (1.0 - val_fraction))
        train_text, val_text = joined[:cut], joined[cut:]
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    train, val = (np.asarray(encode(t), dtype=dtype) for t in (train_text, val_text))
    if len(val) < 2 or len(train) < 2:
        raise SystemExit("error: too little text for a training and a validation split: give more text")
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "train.bin", train)
    _write(out / "val.bin", val)
    meta = {
        "vocab_size": vocab_size,
        "dtype": np.dtype(dtype).name,
        "tokenizer": tokenizer,
        "files": len(files),
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
    }
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files, or folders searched with --glob")
    parser.add_argument("--out", type=Path, required=True, help="folder for train.bin, val.bin, meta.json")
    parser.add_argument("--tokenizer", default="bytes", help="bytes (default) or tiktoken:<encoding>")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of the text for validation")
    parser.add_argument("--glob", default="*.txt", help="which files of a folder to read (default *.txt)")
    args = parser.parse_args(argv)
    meta = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.glob)
    what = f"{meta['tokenizer']}, vocabulary {meta['vocab_size']}, {meta['dtype']}"
    print(f"{args.out}: {meta['train_tokens']} training and {meta['val_tokens']} validation tokens ({what})")


if __name__ == "__main__":
    main()
