"""A run's tune settings, written into run.json, so `--resume` continues the run it was.

A resumed run keeps its recorded stop rule, planner, devices and generations, executor and
LLM options; a flag given on the command line overrides the recorded value, and every
override is said in a note (and recorded, so the next resume keeps it). Values are checked
before any work: a cap of zero, or patience of zero, would stop the search before its first
trial after a whole profile.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError

from agent.errors import UserError
from tools.problem import StopRule

SETTINGS_KEY = "tune"
"""Where the settings live in run.json's `options` (its `stop_rule` is kept beside, for readers)."""


class TuneSettings(BaseModel):
    """How a run is searched; every field maps to one `agent tune` flag."""

    planner: str = "auto"
    """--planner: auto (template, then compiler where templates have nothing new), template,
    compiler, anthropic, openai, files, or several (template,compiler)."""
    llm_model: str | None = None
    """--llm-model for the LLM planners."""
    base_url: str | None = None
    """--base-url of the LLM API."""
    devices: str | None = None
    """--devices (None: every idle GPU, else the CPU)."""
    executor: str = "local"
    """--executor: local or ray."""
    ray_address: str | None = None
    """--ray-address."""
    workers_per_gpu: int = 0
    """--workers-per-gpu (0: by CPU cores per GPU)."""
    stop_rule: StopRule = Field(default_factory=StopRule)
    """--gpu-hours, --max-candidates, --patience, --max-usd."""
    generations: list[str] = Field(default_factory=list)
    """The device generations the run's candidates are tried on (recorded once known)."""
    screen: bool | None = None
    """--screen/--no-screen: a verified candidate clearly slower than its region's best so far is
    not timed in full (tools/screen.py). None: on for GPU timings, off for CPU ones (they say
    nothing of speed under Triton's interpreter, and move too much to screen on)."""
    no_jail: bool = False
    """--no-jail: candidates ran without the sandbox's jail (recorded for the report; a resume
    never inherits it: the user says it again)."""


FLAGS = {"planner": "--planner", "llm_model": "--llm-model", "base_url": "--base-url", "devices": "--devices",
         "executor": "--executor", "ray_address": "--ray-address", "workers_per_gpu": "--workers-per-gpu",
         "gpu_hours": "--gpu-hours", "max_candidates": "--max-candidates", "patience": "--patience",
         "max_usd": "--max-usd", "no_jail": "--no-jail", "screen": "--screen/--no-screen"}
RULE_FIELDS = ("gpu_hours", "max_candidates", "patience", "max_usd")


def recorded(options: dict[str, Any], tuned_before: bool) -> TuneSettings | None:
    """The settings run.json holds, or None for a run never tuned (only profiled). A run tuned
    before settings were recorded keeps at least its stop rule."""
    try:
        if SETTINGS_KEY in options:
            return TuneSettings.model_validate(options[SETTINGS_KEY])
        if "stop_rule" in options and tuned_before:
            return TuneSettings(stop_rule=StopRule.model_validate(options["stop_rule"]))
    except ValidationError as e:
        raise UserError(f"run.json: the recorded tune settings are invalid ({_first(e)})") from None
    return None


def resolve(previous: TuneSettings | None, given: dict[str, Any]) -> tuple[TuneSettings, list[str]]:
    """The settings for this session: `previous` (the run's, on resume) with every value the
    user gave (not None) on top, checked; and a note per recorded value overridden."""
    base = previous or TuneSettings()
    fields = base.model_dump()
    rule = dict(fields.pop("stop_rule"))
    notes = []
    for name, value in given.items():
        if value is None or name == "no_jail":
            continue
        if name in RULE_FIELDS:
            old, rule[name] = rule.get(name), value
        else:
            old, fields[name] = fields.get(name), value
        if previous is not None and old != value:
            notes.append(f"{FLAGS[name]} {_show(value)} overrides the run's recorded {_show(old)}")
    if previous is not None and given.get("devices") is not None and given["devices"] != base.devices:
        fields["generations"] = []  # found again from the new devices
    fields["no_jail"] = bool(given.get("no_jail"))
    if fields["no_jail"]:
        notes.append("--no-jail: candidates run without the sandbox's jail, with your user's rights")
    for key, why in (("max_candidates", "nothing would be tried"),
                     ("patience", "every region would stop before its first trial")):
        if isinstance(rule.get(key), int) and rule[key] < 1:  # one message for 0 and -3 alike
            raise UserError(f"--{key.replace('_', '-')} {rule[key]}: {why}; give 1 or more")
    try:
        settings = TuneSettings(**fields, stop_rule=StopRule(**rule))
    except ValidationError as e:
        raise UserError("; ".join(_message(x) for x in e.errors())) from None
    check(settings)
    return settings, notes


def check(settings: TuneSettings) -> None:
    """Refuse settings under which the search could not try a single candidate."""
    rule = settings.stop_rule
    if rule.max_candidates < 1:
        raise UserError(f"--max-candidates {rule.max_candidates}: nothing would be tried; give 1 or more")
    if rule.gpu_hours <= 0:
        raise UserError(f"--gpu-hours {rule.gpu_hours:g}: no trial fits a cap of zero; give a positive number "
                        "of hours, e.g. 0.25")
    if rule.patience < 1:
        raise UserError(f"--patience {rule.patience}: every region would stop before its first trial; give 1 or "
                        "more")
    if rule.max_usd is not None and rule.max_usd <= 0:
        raise UserError(f"--max-usd {rule.max_usd:g}: no LLM call fits a cap of zero; give a positive amount")
    if settings.workers_per_gpu < 0:
        raise UserError(f"--workers-per-gpu must be 0 (automatic) or more, not {settings.workers_per_gpu}")
    from sandbox.jail import refusal
    if why := refusal([n.strip() for n in settings.planner.split(",")], f"--planner {settings.planner}"):
        raise UserError(why)


def _show(value: Any) -> str:
    return "(none)" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _message(error: dict) -> str:
    msg = error["msg"].removeprefix("Value error, ")
    field = str(error["loc"][-1]) if error["loc"] else ""
    flag = FLAGS.get(field, field)
    return msg.replace(field, flag, 1) if field and field in msg else f"{flag}: {msg}"


def _first(e: ValidationError) -> str:
    x = e.errors()[0]
    return f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
