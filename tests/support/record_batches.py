"""The trainer, recording every micro-batch its loop takes: `python tests/support/record_batches.py OUT TRAINER_ARGS...`
(or under torchrun). Rank r appends one JSON line per micro-batch, its windows (the inputs plus the last label), to
OUT_DIR/rank-r.jsonl in the order the steps took them; the stream resume tests read which documents were trained."""

import json
import os
import sys
from pathlib import Path

import atma_titan.train as trainer


def recorded(batches, path: Path):
    with open(path, "a") as out:
        for batch in batches:
            inputs, labels = batch[0], batch[1]
            out.write(json.dumps([[*row, label[-1]] for row, label in zip(inputs.tolist(), labels.tolist())]) + "\n")
            out.flush()
            yield batch


def recording(open_loader, folder: Path):
    """The trainer's open_loader, with this rank's micro-batches recorded into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{os.environ.get('RANK', '0')}.jsonl"

    def open_recorded_loader(run, *rest):
        open_loader(run, *rest)
        run.batches = recorded(run.batches, path)

    return open_recorded_loader


def main() -> int:
    trainer.open_loader = recording(trainer.open_loader, Path(sys.argv[1]))  # setup() looks it up at call time
    return trainer.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
