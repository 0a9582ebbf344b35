"""The accelerate run test_accelerate launches: ``python tests/accelerate_app.py OUT_DIR``.

Starts 2 CPU processes with ``accelerate.debug_launcher`` (gloo, file rendezvous). Each prepares the
same shuffled dataset twice from the same seed — torch's ``DataLoader`` with accelerate's own
``Accelerator``, then ``shmloader.torch.DataLoader`` with ``shmloader.torch.accelerate.Accelerator``
— iterates one epoch of each and writes ``OUT_DIR/process<N>.json``: per batch, the indices, whether
``GradientState.end_of_dataloader`` was set, and where the batch was made.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SAMPLES, BATCH_SIZE = 16, 2


def _epoch(accelerator: Any, loader: Any) -> list[dict[str, Any]]:
    from framework_helpers import batch_record

    prepared = accelerator.prepare(loader)
    out = []
    for batch in prepared:
        out.append({**batch_record(batch), "end": accelerator.gradient_state.end_of_dataloader,
                    "inner": type(prepared.base_dataloader).__module__})
    return out


def _process(out_dir: str) -> None:
    import accelerate
    from accelerate.utils import set_seed
    from framework_helpers import Indexed
    from torch.utils.data import DataLoader as TorchDataLoader

    import shmloader.torch as st
    from shmloader.torch.accelerate import Accelerator

    # device_placement=False: on several CPU processes accelerate's device is cpu:<index>, and moving a
    # batch there copies it (for torch's loader too), which would hide where the batch was made.
    set_seed(3)
    torch_run = _epoch(accelerate.Accelerator(device_placement=False),
                       TorchDataLoader(Indexed(SAMPLES), batch_size=BATCH_SIZE, shuffle=True, num_workers=2))
    set_seed(3)
    accelerator = Accelerator(device_placement=False)
    ours = _epoch(accelerator, st.DataLoader(Indexed(SAMPLES), batch_size=BATCH_SIZE, shuffle=True,
                                             num_workers=2, slot_bytes=1 << 16))
    record = {"process": accelerator.process_index, "num_processes": accelerator.num_processes,
              "pid": os.getpid(), "torch": torch_run, "shmloader": ours}
    with open(os.path.join(out_dir, f"process{accelerator.process_index}.json"), "w") as out:
        json.dump(record, out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from accelerate import debug_launcher

    debug_launcher(_process, args=(sys.argv[1],), num_processes=2)
