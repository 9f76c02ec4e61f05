"""Real verifiers (0.4) task sets for tests/unit/test_verifiers_env.py, loaded by import path as a recipe names them.
verifiers awaits every reward method (Task.score gathers them), so they are all `async def`."""

from __future__ import annotations

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str
    info: dict = {}


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply.split()[-1:] == [task.answer])

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class Arithmetic(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool(name="divide")
    def div(self, a: float, b: float) -> float:
        """Divide a by b."""
        return a / b


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Arithmetic(vf.ToolsetConfig())]

    def load(self):
        for a, b in [(2, 3), (10, 7), (4, 4)]:
            yield SumTask(
                SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with the number last.",
                        answer=str(a + b), info={"terms": [a, b]})
            )


def sums() -> SumTaskset:
    return SumTaskset(vf.TasksetConfig(id="sums"))


class SetupTask(SumTask):
    async def setup(self, trace, runtime) -> None:
        return None


class Counter(vf.State):
    calls: int = 0


class CountingTools(vf.Toolset[vf.ToolsetConfig, Counter]):
    @vf.tool
    def count(self) -> int:
        """Count the calls."""
        self.state.calls += 1
        return self.state.calls


class SetupTaskset(vf.Taskset[SetupTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CountingTools(vf.ToolsetConfig())]

    def load(self):
        yield SetupTask(SumData(prompt="1 + 1?", answer="2"))


def with_setup() -> SetupTaskset:
    return SetupTaskset(vf.TasksetConfig(id="with-setup"))
