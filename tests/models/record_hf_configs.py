"""Record the `config.json` that the installed transformers writes for each case of `hf_cases.py`,
as `hf_configs/<case>.<transformers version>.json` (the fixtures of `test_config.py`).

    python -m tests.models.record_hf_configs      # with transformers 4.57.1, then with 5.x
"""

import json
import tempfile
from pathlib import Path

import torch
import transformers

from tests.models.hf_cases import CASES

FOLDER = Path(__file__).parent / "hf_configs"


def main():
    for name, kwargs in CASES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**kwargs))
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)  # as a user saves it: with architectures and dtype
            written = json.loads((Path(folder) / "config.json").read_text())
        target = FOLDER / f"{name}.{transformers.__version__}.json"
        target.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        print(target)


if __name__ == "__main__":
    main()
