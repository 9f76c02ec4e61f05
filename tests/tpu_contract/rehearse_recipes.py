"""Every shipped TPU recipe rehearsed in one process (`rlpipe rehearse`'s checks, imports paid once, torch_tpu's
launch helper started once for each job environment), for tests/tpu_contract/test_rehearse.py.
`python -m tests.tpu_contract.rehearse_recipes OUT.json RECIPE[+KEY=VALUE...] ...` writes {name: [check, ...]}; a
name's `+key=value` parts are overrides."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from rlpipe.config.loading import find_recipe, load_config
    from rlpipe.tpu.rehearse import rehearse
    from tests.tpu_contract.launch_helpers import one_helper_per_environment

    out, names = Path(argv[0]), argv[1:]
    results = {}
    with one_helper_per_environment():  # the single-host recipes share one job environment
        for name in names:
            recipe, *overrides = name.split("+")
            checks = rehearse(load_config(find_recipe(f"configs/{recipe}.yaml"), overrides))
            results[name] = [dataclasses.asdict(check) for check in checks]
            out.write_text(json.dumps(results))  # what ran so far, should a later recipe stop the process


if __name__ == "__main__":
    main(sys.argv[1:])
