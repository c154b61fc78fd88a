"""The docs keep up with the code: every hook documented with its exact signature and a
runnable example, every environment variable documented, every hook tested."""

from __future__ import annotations

import inspect
import os
import re

import pytest
from kernelbay import hookspecs
from kernelbay.policy import ENV_VARIABLES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTHORS = os.path.join(ROOT, "docs", "plugin-authors.md")
USERS = os.path.join(ROOT, "docs", "user-guide.md")
HOOKS = sorted(name for name, fn in vars(hookspecs).items()
               if name.startswith("kernelbay_") and inspect.isfunction(fn))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_hookspecs_are_found() -> None:
    assert len(HOOKS) == 6


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_section_with_its_exact_signature(hook: str) -> None:
    fn = getattr(hookspecs, hook)
    signature = f"def {hook}() -> {fn.__annotations__['return']}"
    text = _read(AUTHORS)
    assert f"### {hook}\n" in text, f"docs/plugin-authors.md has no section for {hook}"
    section = text.split(f"### {hook}\n", 1)[1].split("\n### ", 1)[0]
    assert signature in section, f"section {hook} does not show {signature!r}"
    assert "```python" in section, f"section {hook} has no runnable example"


@pytest.mark.parametrize("index", range(len(_python_blocks(_read(AUTHORS)))))
def test_plugin_author_examples_run(index: int) -> None:
    block = _python_blocks(_read(AUTHORS))[index]
    exec(compile(block, f"plugin-authors.md block {index}", "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("variable", sorted(ENV_VARIABLES))
def test_every_environment_variable_is_documented(variable: str) -> None:
    assert f"`{variable}`" in _read(USERS), f"docs/user-guide.md does not document {variable}"


def test_user_guide_example_runs() -> None:
    for block in _python_blocks(_read(USERS)):
        exec(compile(block, "user-guide.md", "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook: str) -> None:
    test_dirs = [os.path.join(ROOT, "core", "tests"), os.path.join(ROOT, "tests")]
    for folder in test_dirs:
        for name in os.listdir(folder):
            is_test = name.startswith("test_") and name.endswith(".py")
            if is_test and name != "test_docs.py" and hook in _read(os.path.join(folder, name)):
                return
    pytest.fail(f"no test under core/tests or tests/ names the hook {hook}")
