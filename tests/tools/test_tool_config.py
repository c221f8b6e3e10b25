"""Tool/interaction YAML loading, schema checks and the Python-function API: bad input is one
ConfigError naming the file, entry and key."""

import asyncio
import json
import textwrap

import pytest

from posttrain.errors import ConfigError
from posttrain.interactions.gsm8k_interaction import Gsm8kInteraction
from posttrain.interactions.registry import load_interaction_config
from posttrain.tools.function_tool import FunctionTool, function_schema
from posttrain.tools.gsm8k_tool import Gsm8kTool
from posttrain.tools.registry import load_tools_config
from posttrain.tools.schemas import OpenAIFunctionToolSchema, argument_problem

VERL_GSM8K_TOOL = """
tools:
  - class_name: "posttrain.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "Checks an answer to a GSM8K problem"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The final answer"
          required: ["answer"]
"""


def _write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_verl_tool_config_loads_and_the_gsm8k_tool_scores(tmp_path):
    (tool,) = load_tools_config(_write(tmp_path, VERL_GSM8K_TOOL))
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"

    async def episode():
        iid, _ = await tool.create(None, ground_truth="72")
        wrong = await tool.execute(iid, {"answer": "70"})
        right = await tool.execute(iid, {"answer": "72"})
        again = await tool.execute(iid, {"answer": "72"})
        reward = await tool.calc_reward(iid)
        await tool.release(iid)
        return wrong, right, again, reward

    wrong, right, again, reward = asyncio.run(episode())
    assert wrong[1] == -0.05 and right[1] == 0.0 and again[1] == -0.05  # no improvement -> penalty
    assert right[0].text == "Parsed answer: 72; reward: 1.0" and reward == 1.0


@pytest.mark.parametrize("edit, message", [
    (("posttrain.tools.gsm8k_tool.Gsm8kTool", "posttrain.tools.nope.Tool"), "tools[0]: class_name posttrain.tools.nope.Tool: cannot import"),
    (("posttrain.tools.gsm8k_tool.Gsm8kTool", "posttrain.tools.gsm8k_tool.Missing"), "has no class Missing"),
    (('type: "function"', 'type: "funktion"'), "tools[0].tool_schema: type must be 'function'"),
    (('required: ["answer"]', 'required: ["answr"]'), "required names ['answr'], which are not in properties"),
    (('type: "string"', 'type: "text"'), "properties.answer.type='text' is not a JSON Schema type"),
    (("type: native", "type: mcp"), "only native tools"),
])
def test_bad_tool_configs_name_file_entry_and_key(tmp_path, edit, message):
    path = _write(tmp_path, VERL_GSM8K_TOOL.replace(*edit))
    with pytest.raises(ConfigError) as err:
        load_tools_config(path)
    assert path in str(err.value) and message in str(err.value)


def test_meta_schema_check_catches_what_the_shape_check_does_not(tmp_path):
    pytest.importorskip("jsonschema")
    path = _write(tmp_path, VERL_GSM8K_TOOL.replace('description: "The final', 'minLength: -3\n              description: "The final'))
    with pytest.raises(ConfigError, match="not a valid JSON Schema at properties.answer.minLength"):
        load_tools_config(path)


def test_interaction_config(tmp_path):
    good = _write(tmp_path, """
        interaction:
          - name: gsm8k
            class_name: posttrain.interactions.gsm8k_interaction.Gsm8kInteraction
            config: {}
        """, "inter.yaml")
    inters = load_interaction_config(good)
    assert list(inters) == ["gsm8k"] and isinstance(inters["gsm8k"], Gsm8kInteraction)
    bad = _write(tmp_path, "interaction:\n  - name: g\n    class_name: posttrain.interactions.gone.X\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml interaction\[0\]: class_name posttrain.interactions.gone.X"):
        load_interaction_config(bad)


def test_gsm8k_interaction_asks_to_try_again_until_right():
    inter = Gsm8kInteraction({"name": "gsm8k"})

    async def run():
        iid = await inter.start_interaction(None, ground_truth="12")
        first = await inter.generate_response(iid, [{"role": "assistant", "content": "#### 11"}])
        second = await inter.generate_response(iid, [{"role": "assistant", "content": "#### 12"}])
        return first, second, await inter.calculate_score(iid)

    first, second, score = asyncio.run(run())
    assert first[0] is False and "try again" in first[1] and first[2] == 0.0
    assert second[:3] == (True, "Your answer is correct.", 1.0) and score == 1.0


def multiply(a: int, b: int, note: str = "") -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor,
            on two lines.
        note: ignored.

    Returns:
        The product.
    """
    return a * b


def test_function_schema_from_hints_and_docstring():
    schema = function_schema(multiply)
    assert schema == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first factor."},
            "b": {"type": "integer", "description": "the second factor, on two lines."},
            "note": {"type": "string", "description": "ignored."}}}}}
    resp, _, _ = asyncio.run(FunctionTool(multiply).execute("i", {"a": 6, "b": 7}))
    assert resp.text == "42"


def test_function_schema_refusals():
    def no_hint(a):
        """Doc.

        Args:
            a: x.
        """

    def no_doc(a: int):
        pass

    with pytest.raises(ConfigError, match="parameter 'a' of no_hint has no type hint"):
        function_schema(no_hint)
    with pytest.raises(ConfigError, match="no_doc has no docstring"):
        function_schema(no_doc)


def test_argument_problems():
    schema = OpenAIFunctionToolSchema.from_dict(function_schema(multiply))
    assert argument_problem(schema, {"a": 1, "b": 2}) is None
    assert "missing required argument(s) ['b']" in argument_problem(schema, {"a": 1})
    assert "unknown argument(s) ['c']" in argument_problem(schema, {"a": 1, "b": 2, "c": 3})
    assert "'a' of multiply must be integer, got str" in argument_problem(schema, {"a": "1", "b": 2})
    assert "must be integer, got bool" in argument_problem(schema, {"a": True, "b": 2})


def test_rows_naming_unknown_tools_interactions_or_loops_are_refused_at_start_up():
    from posttrain.data.schema import DataError
    from posttrain.rollout.multi_turn_checks import check_rows

    good = [{"agent_name": "tool_agent", "extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": {}}},
                                                        "interaction_kwargs": {"name": "gsm8k"}}}]
    check_rows(good, "train.parquet", ["calculator"], ["gsm8k"])
    cases = [
        ({"extra_info": {"tools_kwargs": {"calc": {}}}}, "train.parquet row 1: extra_info.tools_kwargs names unknown tool(s) ['calc']"),
        ({"extra_info": {"interaction_kwargs": {"name": "chat"}}}, "row 1: extra_info.interaction_kwargs.name='chat' is not configured"),
        ({"agent_name": "react_agent"}, "row 1: agent_name='react_agent' is not a loop"),
        ({"extra_info": {"tools_kwargs": {"calculator": "x"}}}, "row 1: extra_info.tools_kwargs.calculator must be a mapping"),
        ({"extra_info": {"tools_kwargs": {"calculator": {"create": {}}}}},
         "row 1: extra_info.tools_kwargs.calculator.create: not a key the loop reads"),
        ({"extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": [1]}}}},
         "row 1: extra_info.tools_kwargs.calculator.create_kwargs must be a mapping of keyword arguments, got list"),
        ({"extra_info": {"interaction_kwargs": "gsm8k"}}, "row 1: extra_info.interaction_kwargs must be a mapping"),
    ]
    for row, message in cases:
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
            check_rows(good + [row], "train.parquet", ["calculator"], ["gsm8k"])
    check_rows(good + [cases[0][0]], "train.parquet", None, ["gsm8k"])  # tool names unchecked until trainer.tools


# ---------------------------------------------------------------- a configured class is checked before it is called
def _popen_payload(marker):
    """A config whose keys, as Popen's argv, run a shell that creates ``marker`` (the reported attack)."""
    return {"/bin/sh": 1, "-c": 1, f"touch {marker}": 1}


def test_a_command_class_in_an_interaction_config_is_refused_before_it_runs(tmp_path):
    import subprocess
    import time

    marker = tmp_path / "ran"
    config = "".join(f"      {json.dumps(k)}: 1\n" for k in _popen_payload(marker))
    path = _write(tmp_path, f"interaction:\n  - name: x\n    class_name: subprocess.Popen\n    config:\n{config}",
                  "evil.yaml")
    with pytest.raises(ConfigError, match=r"evil.yaml interaction\[0\]: class_name subprocess.Popen is not an "
                                          r"interaction.*nothing was constructed"):
        load_interaction_config(path)
    time.sleep(0.5)
    assert not marker.exists()
    # negative control: the payload is real: constructed the way the loader would have, it runs the command
    subprocess.Popen({**_popen_payload(marker), "name": "x"}).wait(10)
    assert marker.exists()


def test_a_command_class_in_a_tool_config_is_refused_before_it_runs(tmp_path):
    import time

    marker = tmp_path / "ran"
    config = "".join(f"      {json.dumps(k)}: 1\n" for k in _popen_payload(marker))
    path = _write(tmp_path, f"tools:\n  - class_name: subprocess.Popen\n    config:\n{config}")
    with pytest.raises(ConfigError, match=r"tools\[0\]: class_name subprocess.Popen is not a tool.*execute"):
        load_tools_config(path)
    time.sleep(0.5)
    assert not marker.exists()


class ProtocolInteraction:
    """An interaction by the documented protocol, without subclassing BaseInteraction."""

    def __init__(self, config):
        self.name = config["name"]

    async def start_interaction(self, instance_id=None, **kwargs):
        return "i"

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        return 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        pass


class HalfInteraction:
    """Has generate_response only (the old check accepted it, after constructing it)."""

    constructed = 0

    def __init__(self, config):
        HalfInteraction.constructed += 1

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "", 0.0, {}


def test_protocol_classes_are_accepted_and_partial_ones_refused_unconstructed(tmp_path):
    good = _write(tmp_path, f"interaction:\n  - name: p\n    class_name: {__name__}.ProtocolInteraction\n", "p.yaml")
    assert isinstance(load_interaction_config(good)["p"], ProtocolInteraction)
    half = _write(tmp_path, f"interaction:\n  - name: h\n    class_name: {__name__}.HalfInteraction\n", "h.yaml")
    with pytest.raises(ConfigError, match="lacks the method.*start_interaction, calculate_score, finalize_interaction"):
        load_interaction_config(half)
    assert HalfInteraction.constructed == 0
