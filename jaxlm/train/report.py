"""What a run leaves to look at: a time table, TensorBoard event files, a loss curve PNG.

    phases = Phases()
    ...                                          # load the model
    phases.mark("load")                          # the seconds since the previous mark
    print(phases.table())                        # seconds per phase and in all
    board = TensorBoard(out)                     # out/tensorboard/events.out.tfevents.*
    board.write(rows)                            # the rows loop.run appends to metrics.jsonl
    plot(out)                                    # out/metrics.png from out/metrics.jsonl

TensorBoard is the JAX ecosystem's convention (MaxText, tunix); tensorboardX writes its event
files without TensorFlow. It writes local files itself; for URLs (`gs://...`) the writer goes
through `jaxlm.storage`, rewriting the object at each flush (object stores cannot append), as
metrics.jsonl does. The PNG is drawn by matplotlib (Agg, no display).
"""
from __future__ import annotations

import io
import json
import time

from jaxlm import storage


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (on CPU it includes the device buffers)."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class Phases:
    """Wall-clock seconds of the consecutive phases of a run, and the process's peak memory at
    the end of each: `mark(name)` closes the phase that began at the previous mark (or at
    creation) and names it. Marks are linear, so the phases add up to the total by construction.
    The peak is the high-water mark so far, so the phase where it rises is where memory went."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.start = self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.peak[name] = peak_rss_bytes()
        self.last = now

    def table(self) -> str:
        """One row per phase and the total: seconds, share, and peak memory at its end (GB)."""
        total = self.last - self.start
        width = max([len(n) for n in self.seconds] + [5])
        lines = [f"time: {'phase':<{width}}  seconds   share   peak memory"]
        lines += [f"      {n:<{width}}  {s:7.1f}  {s / max(total, 1e-9):6.1%}  "
                  f"{self.peak[n] / 1e9:8.2f} GB" for n, s in self.seconds.items()]
        lines.append(f"      {'total':<{width}}  {total:7.1f}")
        return "\n".join(lines)


class _StorageWriter:
    """tensorboardX's record file on a URL: buffered, uploaded whole at each flush."""

    def __init__(self, path: str):
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        storage.write_bytes(self.path, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _StorageWriterFactory:
    def open(self, path):
        return _StorageWriter(path)

    def directory_check(self, path):
        pass  # object stores need no folders


def _tensorboardx():
    """-> tensorboardX's (SummaryWriter, record_writer), imported without the libraries it
    imports only to offer them, where they are installed: torch (to accept torch tensors),
    boto3 and google-cloud-storage (to write to S3 and GCS). jaxlm writes floats, and through
    jaxlm.storage on URLs. torch cost every train.py run 0.18 GB of resident memory, the two
    clients 34 MB more in each process of a run. A library already imported stays as it is."""
    import sys
    hidden = [] if "tensorboardX" in sys.modules else [
        m for m in ("torch", "boto3", "google.cloud.storage") if m not in sys.modules]
    for m in hidden:
        sys.modules[m] = None  # `import m` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter, record_writer
    finally:
        for m in hidden:
            del sys.modules[m]
    return SummaryWriter, record_writer


class TensorBoard:
    """Scalars of every metrics row (loss, accuracy, tokens/s, ...) as TensorBoard events under
    `out/tensorboard/` (`tensorboard --logdir OUT/tensorboard`)."""

    SKIP = ("step",)

    def __init__(self, out: str):
        SummaryWriter, record_writer = _tensorboardx()
        logdir = storage.join(out, "tensorboard")
        if storage.is_url(logdir):
            record_writer.register_writer_factory(logdir.split("://")[0], _StorageWriterFactory())
        else:
            storage.makedirs(logdir)
        self.writer = SummaryWriter(logdir)

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            for key, value in row.items():
                if key not in self.SKIP and isinstance(value, (int, float)):
                    tag = f"validation/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                    self.writer.add_scalar(tag, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file in `logdir` (local or URL), in file
    order: what TensorBoard would plot, read with its own protobuf (shipped by tensorboardX)."""
    from tensorboardX.proto import event_pb2
    from jaxlm.tfrecord import read_records
    out: dict[str, list] = {}
    for name in sorted(storage.listdir(logdir)):
        with storage.open_file(storage.join(logdir, name), "rb") as f:
            for record in read_records(f, name):
                event = event_pb2.Event.FromString(record)
                for v in event.summary.value:
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def read_metrics(out: str) -> list[dict]:
    path = storage.join(out, "metrics.jsonl")
    if not storage.exists(path):
        return []
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def plot(out: str, name: str = "metrics.png") -> str | None:
    """Loss and token accuracy against the step, from out/metrics.jsonl -> the PNG's path
    (None when there is nothing to draw). A resumed run's rows all count."""
    rows = read_metrics(out)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    steps = [r["step"] for r in rows]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    loss_ax.plot(steps, [r["loss"] for r in rows], color="tab:blue")
    loss_ax.set(xlabel="step", ylabel="loss", title="training loss")
    acc_ax.plot(steps, [r["accuracy"] for r in rows], color="tab:green")
    acc_ax.set(xlabel="step", ylabel="token accuracy", title="token accuracy", ylim=(0, 1))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    path = storage.join(out, name)
    storage.write_bytes(path, buf.getvalue())
    return path
