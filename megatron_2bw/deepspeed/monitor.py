"""`engine.monitor`: DeepSpeed's monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`).

Events are DeepSpeed's (name, value, step) tuples; the engine writes DeepSpeed's
`Train/Samples/train_loss` and `Train/Samples/lr` after every batch (not DeepSpeed's fp16
`Train/Samples/loss_scale`: the engine's surface does not show the scale), at step =
global_samples, on global rank 0, as DeepSpeed's pipeline engine does. TensorBoard and wandb go
through the project's writers (training/observe/writers.py); the TensorBoard run is
`<output_path>/<job_name>` as in DeepSpeed; the wandb run is DeepSpeed's `project` (default
"deepspeed"), `group` and `team` (wandb's entity), in the mode WANDB_MODE says (offline when
unset), its step DeepSpeed's (global samples). csv_monitor writes DeepSpeed's files:
`<output_path>/<job_name>/<name with '/' and ' ' as '_'>.csv`, a header `step,<last part of the
name>`, then one `step,value` row per event. comet needs the comet_ml package (one line if it is
missing, before any process group: config/ds_json/monitors.py).
"""
from __future__ import annotations

import csv
import dataclasses
import os


class CsvMonitor:
    def __init__(self, section: dict):
        self.log_dir = os.path.join(section.get("output_path") or "",
                                    section.get("job_name") or "DeepSpeedJobName")
        os.makedirs(self.log_dir, exist_ok=True)
        self.filenames = set()

    def write_events(self, events) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, filename + ".csv")
            with open(path, "a", newline="") as f:   # an append-only log, like DeepSpeed's
                out = csv.writer(f)
                if filename not in self.filenames:
                    self.filenames.add(filename)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass


class _WriterMonitor:
    """A project writer (TensorBoardWriter, WandbWriter) fed DeepSpeed's events."""

    def __init__(self, writer):
        self.writer = writer

    def write_events(self, events) -> None:
        by_step = {}
        for name, value, step in events:
            by_step.setdefault(int(step), {})[name] = float(value)
        for step, values in sorted(by_step.items()):
            self.writer.write(step, values)

    def close(self) -> None:
        self.writer.close()


class CometMonitor:
    def __init__(self, section: dict):
        import comet_ml
        self.experiment = comet_ml.start(
            api_key=section.get("api_key"), project=section.get("project"),
            workspace=section.get("workspace"), experiment_key=section.get("experiment_key"),
            mode=section.get("mode"), online=section.get("online"))
        if section.get("experiment_name"):
            self.experiment.set_name(section["experiment_name"])

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.experiment.__internal_api__log_metric__(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


def _on(ds: dict, key: str) -> dict | None:
    section = ds.get(key)
    return section if isinstance(section, dict) and section.get("enabled", False) else None


class Monitor:
    """DeepSpeed's MonitorMaster: every enabled monitor, on global rank 0 only."""

    def __init__(self, ds: dict, cfg, rank: int):
        self.monitors = []
        sections = {k: _on(ds, k) for k in ("tensorboard", "wandb", "csv_monitor", "comet")}
        self.enabled = any(s is not None for s in sections.values())
        if rank != 0:
            return
        if sections["tensorboard"] is not None:
            from megatron_2bw.training.observe.writers import TensorBoardWriter
            tb = sections["tensorboard"]
            path = os.path.join(tb.get("output_path") or "", tb.get("job_name") or
                                "DeepSpeedJobName")
            train = dataclasses.replace(cfg.train, tensorboard_dir=path)
            self.monitors.append(_WriterMonitor(TensorBoardWriter(
                dataclasses.replace(cfg, train=train))))
        if sections["wandb"] is not None:  # DeepSpeed's: project (default "deepspeed"),
            from megatron_2bw.training.observe.writers import WandbWriter  # group, team
            wb = sections["wandb"]
            self.monitors.append(_WriterMonitor(WandbWriter(
                cfg, project=wb.get("project") or "deepspeed", entity=wb.get("team"),
                group=wb.get("group"))))
        if sections["csv_monitor"] is not None:
            self.monitors.append(CsvMonitor(sections["csv_monitor"]))
        if sections["comet"] is not None:
            self.monitors.append(CometMonitor(sections["comet"]))

    def write_events(self, event_list) -> None:
        for m in self.monitors:
            m.write_events(event_list)

    def close(self) -> None:
        for m in self.monitors:
            m.close()
