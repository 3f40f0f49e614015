"""What the frontend needs to process images for the served model, sent in the handshake as JSON.

The image processor's settings come from the model directory's ``preprocessor_config.json`` (or the
``image_processor`` entry of ``processor_config.json``); the placeholder token and count from the model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from services.worker.models.idefics3 import Idefics3Args
from services.worker.models.llava import LlavaArgs

PROCESSOR_KEYS = (
    "do_resize",
    "size",
    "resample",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "do_image_splitting",
    "max_image_size",
)


def image_processor_settings(model_dir: str) -> dict[str, Any]:
    """The image processor's settings in ``model_dir`` ({} when it has none)."""
    pre = os.path.join(model_dir, "preprocessor_config.json")
    if os.path.isfile(pre):
        with open(pre, encoding="utf-8") as f:
            data = json.load(f)
    else:
        proc = os.path.join(model_dir, "processor_config.json")
        if not os.path.isfile(proc):
            return {}
        with open(proc, encoding="utf-8") as f:
            data = json.load(f).get("image_processor", {})
    return {k: data[k] for k in PROCESSOR_KEYS if k in data}


def multimodal_config(args: Any, model_dir: str, tokenizer) -> str:
    """The handshake's ``multimodal_config`` ('' for a text model)."""
    if not isinstance(args, LlavaArgs | Idefics3Args):
        return ""
    return json.dumps(
        {
            "kind": "llava" if isinstance(args, LlavaArgs) else "idefics3",
            "image_token": tokenizer.convert_ids_to_tokens(args.image_token_id),
            "image_token_id": args.image_token_id,
            "num_image_tokens": args.num_image_tokens,
            "image_size": args.vision.image_size,
            "image_processor": image_processor_settings(model_dir),
        },
        sort_keys=True,
    )
