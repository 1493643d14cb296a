"""What the examples of the README and docs/ build on: a character GPT, its text, benchmark models.

`pipeline.examples.gpt` (the GPT builder and `lm_loss`), `pipeline.examples.text` (the shipped
Shakespeare and a character tokenizer), `pipeline.examples.models` (the benchmark suite's
models, by name). Imported by module: none of them is loaded with `pipeline`.
"""

__all__: list[str] = []
