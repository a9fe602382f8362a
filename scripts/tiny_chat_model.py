"""Write a tiny Hugging Face model folder with a chat template that renders tools: the model the scaffold
example runs on a CPU (`configs/scaffold/smolagents_toy_repo.yaml`) and the server tests use.

    python scripts/tiny_chat_model.py DIR

DIR gets a randomly initialised tiny Qwen3-MoE (`sao_jax.models.tiny_qwen3_moe`, `save_pretrained`),
a byte-level BPE trained here on a few lines (`tokenizers`), and a ChatML template with Hermes-style
tool calls (`<tool_call>{"name": …, "arguments": …}</tool_call>`, the format the chat server parses).
Its actions are noise; it exists to run the plumbing end to end, not to solve anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sao_jax import models as sao_models

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TOOLS = r"""{%- set rest = messages -%}
{%- if messages[0].role == 'system' -%}{%- set rest = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- 'Tools:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\nCall a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}{% generation %}{{- m.content or '' -}}
{%- for call in (m.tool_calls or []) -%}
{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>' -}}{% endgeneration %}{{- '\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Lines like what the scaffold example sends (its task, its tools' JSON schemas, test output), so the
# 1,024-token BPE spells them in a few hundred tokens rather than one token per byte.
CORPUS = ["def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5", "<tool_call>{\"name\": \"run_tests\", "
          "\"arguments\": {}}</tool_call>", "<tool_response>\nFAILED test_add\n</tool_response>",
          "The tests of `add` in test_calc.py fail. Fix the bug in calc.py so that every test passes. Use the tools "
          "to read files, write files and run the tests; do not change test_calc.py.",
          "You fix bugs in a small Python repository (calc.py, test_calc.py). Call exactly one tool per step. "
          "When the tests pass, call final_answer.",
          '{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.", '
          '"parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "the '
          'file\'s name, e.g. calc.py"}}, "required": ["path"]}}}',
          '{"type": "function", "function": {"name": "write_file", "description": "Replace a file of the '
          'repository.", "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": '
          '"the file\'s name, e.g. calc.py"}, "content": {"type": "string", "description": "the file\'s new '
          'text"}}, "required": ["path", "content"]}}}',
          '{"type": "function", "function": {"name": "final_answer", "description": "Provides a final answer to '
          'the given problem.", "parameters": {"type": "object", "properties": {"answer": {"type": "any", '
          '"description": "The final answer to the problem"}}, "required": ["answer"]}}}',
          "Error:\nError while parsing tool call from model output: The model output does not contain any JSON "
          "blob.\nNow let's retry: take care not to repeat previous errors! If you have retried several times, try "
          "a completely different approach.\n", "Observation:\ntests failed\nFAIL test_add_0 AssertionError"]


def write_tokenizer(folder: Path, template: str = CHATML_TOOLS) -> Path:
    """A byte-level BPE (1,024 tokens) with ChatML special tokens and `template` as its chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
              "chat_template": template}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_tiny_chat_model(folder: str | Path, *, seed: int = 0, max_position_embeddings: int = 4096) -> Path:
    """`folder` with the tokenizer above and a tiny Qwen3-MoE whose vocabulary covers it."""
    folder = write_tokenizer(Path(folder))
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = sao_models.tiny_qwen3_moe(vocab_size=vocab, max_position_embeddings=max_position_embeddings)
    sao_models.save_pretrained(sao_models.Policy(config, rngs=nnx.Rngs(seed)), folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to write the model folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_chat_model(args.folder, seed=args.seed))


if __name__ == "__main__":
    main()
