"""What a checkpoint's model/ folder needs beside the weights to be served as it is.

The tokenizer's files (tokenizer.json, tokenizer_config.json with the chat template, special tokens,
chat_template.jinja, ...), the source model's generation_config.json, and its config.json, whose fields
`write_folder` keeps under the ones SlideDP writes (pad_token_id, rope settings, anything a server
reads). The launcher stages them once per run in <run dir>/serve/, under the names transformers
looks for, and every checkpoint copies them in (hashed with the rest of the checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .setup import tokenizer_path
from .tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    from slidedp.config import JobConfig

SOURCE_FILES = ("config.json", "generation_config.json")


def stage_serve_files(job: "JobConfig", folder: Path) -> list[Path]:
    """Copy what model/ needs into `folder` (replacing what a previous run left); returns the files."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tok = tokenizer_path(job)
    if tok is not None:
        shutil.copyfile(tok, folder / "tokenizer.json")
        for name in TOKENIZER_FILES[1:]:
            if (tok.parent / name).is_file():
                shutil.copyfile(tok.parent / name, folder / name)
    if job.model.source == "hf":
        for name in SOURCE_FILES:
            if (Path(job.model.path) / name).is_file():
                shutil.copyfile(Path(job.model.path) / name, folder / name)
    if job.data.chat_template:  # the template the run trained with is the one to serve with
        template = Path(job.data.chat_template).read_text(encoding="utf-8")
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        (folder / "chat_template.json").unlink(missing_ok=True)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        config["chat_template"] = template
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, config_path)
    return sorted(folder.iterdir())


