"""A plan notebook the model drives through tools.

The model breaks a long task into ordered subtasks with ``create_plan``,
works through them (``update_subtask_state``, ``finish_subtask``), changes the
plan when it learns more (``revise_current_plan``) and closes it with
``finish_plan``. Before each reasoning step the agent injects
:meth:`PlanNotebook.hint`, which says where the plan stands and what to do next.

All state is pydantic, so a notebook round-trips through JSON inside the
agent's state. Tool calls never raise on bad input: a refusal is a
:class:`PlanToolResult` with ``ok=False`` and a message the model can act on,
and leaves the notebook unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetbus.protocol import ToolSpec, utc_now

__all__ = ["Plan", "PlanNotebook", "PlanState", "PlanToolResult", "SubTask", "SubTaskState"]

SubTaskState = Literal["todo", "in_progress", "done", "abandoned"]
PlanState = Literal["todo", "in_progress", "done", "abandoned"]
_FINISHED = ("done", "abandoned")
_SHORT = 200  # characters of an outcome in compact renderings


class SubTask(BaseModel):
    """One step of a plan."""

    name: str
    description: str
    expected_outcome: str
    state: SubTaskState = "todo"
    outcome: str | None = None
    """What finishing it produced, as the model reported."""


class Plan(BaseModel):
    """A task broken into ordered subtasks."""

    name: str
    description: str
    expected_outcome: str
    subtasks: list[SubTask]
    state: PlanState = "todo"
    outcome: str | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class PlanToolResult:
    """What a plan tool call answers.

    Attributes:
        ok: whether the call did what it asked; on ``False`` nothing changed.
        text: what the model sees.
    """

    ok: bool
    text: str


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class _SubTaskArgs(_Args):
    name: str = Field(min_length=1, description="Short name of the subtask.")
    description: str = Field(min_length=1, description="What to do, concretely.")
    expected_outcome: str = Field(min_length=1, description="What exists once it is done.")


# The docstrings below are the tool descriptions the model reads.
class _CreatePlan(_Args):
    """Create a plan for a task that needs several steps (many tool calls, or parts that
    depend on each other). Break it into ordered subtasks, each with a concrete expected
    outcome. Do not plan simple requests you can answer directly. Only one plan can be active:
    if one exists, change it with revise_current_plan or end it with finish_plan. After
    creating it, start subtask 0 with update_subtask_state."""

    name: str = Field(min_length=1, description="Short name of the plan.")
    description: str = Field(min_length=1, description="The task the plan achieves.")
    expected_outcome: str = Field(min_length=1, description="What exists once the plan is done.")
    subtasks: list[_SubTaskArgs] = Field(min_length=1, description="The steps, in order.")


class _RevisePlan(_Args):
    """Change the current plan when you learn it is wrong or incomplete. action='add' inserts
    `subtask` at subtask_idx (use the number of subtasks to append); 'revise' replaces the
    name, description and expected outcome of the subtask at subtask_idx; 'delete' removes it.
    A new subtask can only go after the started ones, only todo subtasks can be deleted
    (abandon started ones with update_subtask_state), and finished ones cannot be changed."""

    subtask_idx: int = Field(description="Index of the subtask to add at, revise or delete.")
    action: Literal["add", "revise", "delete"]
    subtask: _SubTaskArgs | None = Field(None, description="The new subtask (add and revise).")


class _UpdateState(_Args):
    """Set a subtask's state: 'in_progress' when you start working on it (one at a time, and
    every earlier subtask must be done or abandoned), 'todo' to put a started subtask back,
    'abandoned' when it turns out unnecessary or impossible. To mark a subtask done, call
    finish_subtask instead."""

    subtask_idx: int
    state: Literal["todo", "in_progress", "abandoned"]


class _FinishSubtask(_Args):
    """Mark a subtask done once its expected outcome is achieved, recording the concrete
    outcome (results, names, facts found) that later steps need. Every earlier subtask must be
    done or abandoned. The next todo subtask is started automatically."""

    subtask_idx: int
    subtask_outcome: str = Field(min_length=1, description="What the subtask produced.")


class _ViewSubtasks(_Args):
    """Show the full details (description, expected outcome, state, outcome) of the subtasks
    at the given indices; an empty list shows all. Use it when the plan hint is not enough."""

    subtask_idx: list[int] = Field(description="Indices to show; an empty list shows all.")


class _FinishPlan(_Args):
    """End the current plan. state='done' once every subtask is done or abandoned and the task
    is complete, with the final result as outcome; state='abandoned' when the plan should be
    dropped (the request changed, or it cannot be achieved), with the reason. The plan moves
    to history and a new one can be created."""

    state: Literal["done", "abandoned"]
    outcome: str = Field(min_length=1, description="The final result, or why it was abandoned.")


class _ViewHistory(_Args):
    """List the plans finished or abandoned earlier, with their outcomes. Use it to recall
    past work before planning something related."""


_TOOLS: dict[str, type[_Args]] = {
    "create_plan": _CreatePlan,
    "revise_current_plan": _RevisePlan,
    "update_subtask_state": _UpdateState,
    "finish_subtask": _FinishSubtask,
    "view_subtasks": _ViewSubtasks,
    "finish_plan": _FinishPlan,
    "view_historical_plans": _ViewHistory,
}


class _RefusalError(Exception):
    """A plan tool refuses; raised before any change, answered as ``ok=False``."""


def _clean_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The arguments' JSON Schema: ``$ref`` inlined, no ``title``, no top description."""
    raw = model.model_json_schema()
    defs: dict[str, Any] = raw.pop("$defs", {})
    raw.pop("description", None)

    def clean(node: Any) -> Any:
        if isinstance(node, list):
            return [clean(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            return clean({**target, **{k: v for k, v in node.items() if k != "$ref"}})
        return {
            key: {n: clean(v) for n, v in value.items()} if key == "properties" else clean(value)
            for key, value in node.items()
            if key != "title"
        }

    schema: dict[str, Any] = clean(raw)
    return schema


_SCHEMAS = {name: _clean_schema(model) for name, model in _TOOLS.items()}


def _short(text: str) -> str:
    return text if len(text) <= _SHORT else text[: _SHORT - 1] + "…"


def _render_subtasks(plan: Plan) -> str:
    return "\n".join(
        f"  {i}. [{s.state}] {s.name}" + (f" -> {_short(s.outcome)}" if s.outcome else "")
        for i, s in enumerate(plan.subtasks)
    )


def _render_subtask(idx: int, sub: SubTask) -> str:
    text = (
        f"Subtask {idx}: {sub.name} [{sub.state}]\n"
        f"  description: {sub.description}\n  expected outcome: {sub.expected_outcome}"
    )
    return text + (f"\n  outcome: {sub.outcome}" if sub.outcome is not None else "")


def _errors(name: str, exc: ValidationError) -> str:
    lines = [f"Invalid arguments for {name}; nothing changed. Fix these and call it again:"]
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "arguments"
        message = "must be a JSON object" if error["type"] == "model_type" else error["msg"]
        if name == "update_subtask_state" and where == "state" and error["input"] == "done":
            message += "; to mark a subtask done, call finish_subtask"
        lines.append(f"- {where}: {message}")
    return "\n".join(lines)


class PlanNotebook(BaseModel):
    """The current plan and the finished ones, changed only through plan tools.

    Offer :meth:`tool_specs` to the model, route the calls :meth:`handles` to
    :meth:`call`, and inject :meth:`hint` before each reasoning step.
    """

    plan: Plan | None = None
    history: list[Plan] = Field(default_factory=list)
    """Finished or abandoned plans, oldest first."""
    max_subtasks: int | None = Field(default=None, ge=1)
    """At most this many subtasks in a plan (``None``: no limit)."""

    TOOL_NAMES: ClassVar[frozenset[str]] = frozenset(_TOOLS)

    def tool_specs(self) -> list[ToolSpec]:
        """The plan tools, to offer the model."""
        specs = []
        for name, model in _TOOLS.items():
            description = " ".join((model.__doc__ or "").split())
            if name == "create_plan" and self.max_subtasks is not None:
                description += f" At most {self.max_subtasks} subtasks."
            schema = copy.deepcopy(_SCHEMAS[name])
            specs.append(ToolSpec(name=name, description=description, parameters=schema))
        return specs

    def handles(self, name: str) -> bool:
        """Whether ``name`` is a plan tool."""
        return name in self.TOOL_NAMES

    def call(self, name: str, arguments: Any) -> PlanToolResult:
        """Run a plan tool; never raises for bad input.

        Args:
            name: the tool's name.
            arguments: the arguments the model sent: a dict, a JSON string, or
                ``None`` for no arguments.

        Returns:
            The result to show the model; on ``ok=False`` nothing changed.
        """
        if name not in _TOOLS:
            return PlanToolResult(
                False, f"Unknown plan tool {name!r}; use one of {sorted(_TOOLS)}."
            )
        if arguments is None or arguments == "":
            arguments = {}
        model = _TOOLS[name]
        try:
            if isinstance(arguments, str | bytes):
                args = model.model_validate_json(arguments)
            else:
                args = model.model_validate(arguments)
        except ValidationError as exc:
            return PlanToolResult(False, _errors(name, exc))
        try:
            text: str = getattr(self, f"_{name}")(args)
        except _RefusalError as exc:
            return PlanToolResult(False, str(exc))
        return PlanToolResult(True, text)

    def hint(self) -> str | None:
        """What to tell the model before its next reasoning step (``None``: no plan)."""
        plan = self.plan
        if plan is None:
            return None
        head = (
            f"<plan_hint>\nCurrent plan: {plan.name} [{plan.state}]\n"
            f"Expected outcome: {plan.expected_outcome}\nSubtasks:\n{_render_subtasks(plan)}\n"
        )
        subs = plan.subtasks
        current = next((i for i, s in enumerate(subs) if s.state == "in_progress"), None)
        pending = next((i for i, s in enumerate(subs) if s.state == "todo"), None)
        if current is not None:
            sub = subs[current]
            advice = (
                f"Now work on subtask {current} '{sub.name}': {sub.description}\n"
                f"Expected outcome: {sub.expected_outcome}\n"
                f"When it is achieved, call finish_subtask(subtask_idx={current}, "
                "subtask_outcome=...) with the concrete result. If the plan no longer fits, "
                "call revise_current_plan or update_subtask_state(state='abandoned')."
            )
        elif pending is not None:
            verb = "The plan was just created. Start" if plan.state == "todo" else "Next, start"
            advice = (
                f"{verb} subtask {pending} '{subs[pending].name}' by calling "
                f"update_subtask_state(subtask_idx={pending}, state='in_progress'), "
                "or change the plan first with revise_current_plan."
            )
        else:
            advice = (
                "All subtasks are finished. Call finish_plan(state='done', outcome=...) with the "
                "final result, or finish_plan(state='abandoned', ...) if the task was not achieved."
            )
        return head + advice + "\n</plan_hint>"

    def _current(self, action: str) -> Plan:
        if self.plan is None:
            raise _RefusalError(f"Cannot {action}: there is no current plan; use create_plan.")
        return self.plan

    def _locate(
        self, idx: int, action: str, *, append: bool = False, ordered: bool = False
    ) -> Plan:
        """The current plan, once ``idx`` is in range (or the end, to append) and, if
        ``ordered``, every subtask before it is finished."""
        plan = self._current(action)
        last = len(plan.subtasks) - (0 if append else 1)
        if not 0 <= idx <= last:
            raise _RefusalError(f"Cannot {action}: subtask_idx {idx} is out of range (0-{last}).")
        for i, other in enumerate(plan.subtasks[:idx] if ordered else []):
            if other.state not in _FINISHED:
                raise _RefusalError(
                    f"Cannot {action}: earlier subtask {i} '{other.name}' is {other.state}. "
                    "Finish or abandon the earlier subtasks first."
                )
        return plan

    def _create_plan(self, args: _CreatePlan) -> str:
        if self.plan is not None:
            raise _RefusalError(
                f"Cannot create a plan: plan '{self.plan.name}' is still active. Change it with "
                "revise_current_plan, or end it with finish_plan first."
            )
        if self.max_subtasks is not None and len(args.subtasks) > self.max_subtasks:
            raise _RefusalError(
                f"Cannot create a plan with {len(args.subtasks)} subtasks: at most "
                f"{self.max_subtasks} are allowed. Merge some steps."
            )
        subtasks = [SubTask(**sub.model_dump()) for sub in args.subtasks]
        fields = args.model_dump(exclude={"subtasks"})
        self.plan = Plan(**fields, subtasks=subtasks, created_at=utc_now())
        return (
            f"Plan '{args.name}' created:\n{_render_subtasks(self.plan)}\n"
            "Start subtask 0 with update_subtask_state."
        )

    def _revise_current_plan(self, args: _RevisePlan) -> str:
        idx, action = args.subtask_idx, args.action
        what = f"{action} subtask {idx}"
        plan = self._locate(idx, what, append=action == "add")
        new = args.subtask.model_dump() if args.subtask is not None else None
        if action != "delete" and new is None:
            raise _RefusalError(f"Cannot {what}: give `subtask` (name, description, ...).")
        if action == "add":
            started = [i for i, s in enumerate(plan.subtasks) if s.state != "todo"]
            if started and idx <= started[-1]:
                raise _RefusalError(
                    f"Cannot {what}: subtask {started[-1]} has already started, so a new "
                    f"subtask must go at index {started[-1] + 1} or later."
                )
            if self.max_subtasks is not None and len(plan.subtasks) >= self.max_subtasks:
                raise _RefusalError(f"Cannot {what}: the plan has the maximum of subtasks.")
            plan.subtasks.insert(idx, SubTask(**(new or {})))
            return f"Subtask added at {idx}.\n{_render_subtasks(plan)}"
        sub = plan.subtasks[idx]
        if sub.state in _FINISHED:
            raise _RefusalError(f"Cannot {what}: it is already {sub.state}; add a new one.")
        if action == "revise":
            plan.subtasks[idx] = sub.model_copy(update=new)
            return f"Subtask {idx} revised.\n{_render_subtasks(plan)}"
        if sub.state != "todo":
            raise _RefusalError(
                f"Cannot {what}: it is {sub.state}. Abandon it with update_subtask_state instead."
            )
        if len(plan.subtasks) == 1:
            raise _RefusalError(
                f"Cannot {what}: it is the only one. Revise it, or end the plan with "
                "finish_plan(state='abandoned', ...)."
            )
        del plan.subtasks[idx]
        return f"Subtask {idx} deleted.\n{_render_subtasks(plan)}"

    def _update_subtask_state(self, args: _UpdateState) -> str:
        idx, state = args.subtask_idx, args.state
        what = f"set subtask {idx} to {state}"
        plan = self._locate(idx, what)
        sub = plan.subtasks[idx]
        if sub.state in _FINISHED:
            raise _RefusalError(
                f"Cannot {what}: '{sub.name}' is already {sub.state}, which is final. "
                "Add a new subtask with revise_current_plan if the work is still needed."
            )
        if sub.state == state:
            raise _RefusalError(f"Subtask {idx} '{sub.name}' is already {state}; nothing changed.")
        if state == "in_progress":
            self._locate(idx, what, ordered=True)
            for i, other in enumerate(plan.subtasks):
                if other.state == "in_progress":
                    raise _RefusalError(
                        f"Cannot {what}: subtask {i} '{other.name}' is in progress and only one "
                        "can be. Finish it with finish_subtask, or set it back first."
                    )
            plan.state = "in_progress"
        sub.state = state
        return f"Subtask {idx} '{sub.name}' is now {state}."

    def _finish_subtask(self, args: _FinishSubtask) -> str:
        idx = args.subtask_idx
        what = f"finish subtask {idx}"
        plan = self._locate(idx, what)
        sub = plan.subtasks[idx]
        if sub.state in _FINISHED:
            raise _RefusalError(f"Cannot {what}: '{sub.name}' is already {sub.state}.")
        self._locate(idx, what, ordered=True)
        sub.state, sub.outcome, plan.state = "done", args.subtask_outcome, "in_progress"
        later = enumerate(plan.subtasks[idx + 1 :], start=idx + 1)
        nxt = next(((i, s) for i, s in later if s.state == "todo"), None)
        if nxt is None:
            return f"Subtask {idx} is done. All subtasks are finished: call finish_plan."
        nxt[1].state = "in_progress"
        return f"Subtask {idx} is done. Now in progress:\n{_render_subtask(*nxt)}"

    def _view_subtasks(self, args: _ViewSubtasks) -> str:
        plan = self._current("view subtasks")
        indices = args.subtask_idx or list(range(len(plan.subtasks)))
        for idx in indices:
            self._locate(idx, "view subtasks")
        return "\n".join(_render_subtask(i, plan.subtasks[i]) for i in indices)

    def _finish_plan(self, args: _FinishPlan) -> str:
        plan = self._current("finish the plan")
        open_ = [i for i, s in enumerate(plan.subtasks) if s.state not in _FINISHED]
        if args.state == "done" and open_:
            raise _RefusalError(
                f"Cannot finish the plan as done: subtasks {open_} are not done or abandoned. "
                "Finish or abandon them first, or finish the plan with state='abandoned'."
            )
        for i in open_:
            plan.subtasks[i].state = "abandoned"
        plan.state, plan.outcome, plan.finished_at = args.state, args.outcome, utc_now()
        self.history.append(plan)
        self.plan = None
        return f"Plan '{plan.name}' finished as {args.state} and moved to history."

    def _view_historical_plans(self, args: _ViewHistory) -> str:
        if not self.history:
            return "No plans have been finished yet."
        return "\n".join(
            f"{i}. {p.name} [{p.state}]: {p.description} -> {_short(p.outcome or '')}"
            for i, p in enumerate(self.history)
        )
