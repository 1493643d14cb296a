"""Functions run on spawned gloo ranks by tests/pipeline/test_traced_dist.py: models split from
their exported graphs, one stage (or two) per process (importable by child processes, so they
live in a module of their own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import Pipe
from tests.models_traced import (
    LR,
    STEPS,
    Case,
    Record,
    bert_case,
    exports_reused,
    gpt2_case,
    llama_case,
    reference_steps,
    token_count,
    unet_case,
)
from tests.pipeline.sharded_workers import pack, snapshot

__all__ = ["CASES", "TWO_PER_RANK", "changing_batches", "checkpoint_across_splits",
           "load_other_split", "meta_stage", "model_tensors", "reusing_exports",
           "save_and_gather", "split_points", "train_like_the_model"]

CASES = {"gpt2": gpt2_case, "llama": llama_case, "bert": bert_case, "unet": unet_case}
TWO_PER_RANK = {"interleaved", "zb-v"}  # schedules that hold two stages on every rank
# fp32, summation order only (see tests/models_traced.py's assert_same_training): gradients
# and losses to rtol 1e-5, atol 1e-6 for values that are zero in exact arithmetic; weights
# after AdamW to atol 1e-5, since AdamW moves a weight by lr x g / (|g| + 1e-8), so a
# rounding-noise gradient moves it by up to lr x noise / 1e-8.
TOL = {"rtol": 1e-5, "atol": 1e-6}
STATE_TOL = {"rtol": 1e-5, "atol": 1e-5}


def reusing_exports(rank: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(rank, *args)` with each graph exported once per process (`exports_reused`): a
    scenario run in turn after others that exported the same model from the same inputs in
    the same mode (and dtypes) gets a copy of that graph instead of exporting it again, most
    of a Pipe's set-up. What it checks of the Pipe (splitting, captures again at other
    lengths or dtypes, which export anew, training) runs as it would."""
    with exports_reused():
        return fn(rank, *args)


def split_points(case: Case, schedule: str) -> list[str]:
    """Two stages (one per rank) at the middle block, or four (two per rank) at every block."""
    return case.blocks[1:] if schedule in TWO_PER_RANK else [case.blocks[2]]


def _ends(pipe: Pipe) -> tuple[bool, bool]:
    """Whether this rank holds the first stage (needs the input) and the last (the target)."""
    return 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages


def _step(pipe: Pipe, case: Case, weight: Any = token_count) -> torch.Tensor:
    """One step, each rank passing only what its stages need (None for the rest), as ranks
    of a real job that load only their share of the data would."""
    first, last = _ends(pipe)
    return pipe.step(case.inputs if first else None, case.labels if last else None, case.loss,
                     loss_weight=weight)


def _model_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss a Hugging Face model computes itself when called with `labels=`."""
    return out.loss


def _shifted_count(target: torch.Tensor) -> torch.Tensor:
    """What a causal LM's own loss averages over: the labels not -100 after the first
    position (label t is predicted from the tokens before it)."""
    return (target[:, 1:] != -100).sum()


def _labels_inside(case: Case) -> Case:
    """The case with its labels given to the model (`model(..., labels=labels).loss`): an
    int64 input the first stage does not use, carried across the cut to the head."""
    return Case(case.name, case.build, {**case.inputs, "labels": case.labels}, case.labels,
                case.blocks, _model_loss)


def _check_step(pipe: Pipe, want: Record, step: int, loss: torch.Tensor, what: str
                ) -> set[str]:
    """This rank's loss and gradients at `step` equal the unsplit model's; returns the names
    of the parameters it checked."""
    torch.testing.assert_close(loss, want.losses[step], **TOL,
                               msg=lambda m: f"{what}: loss of step {step}: {m}")
    names = set()
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no gradient at step {step}"
        torch.testing.assert_close(p.grad, want.grads[step][name], **TOL,
                                   msg=lambda m, n=name: f"{what}: grad {n}, step {step}: {m}")
        names.add(name)
    return names


def _check_state(pipe: Pipe, want: Record, step: int, what: str) -> set[str]:
    """This rank's parameters and buffers after step `step`'s optimizer step equal the unsplit
    model's, by the model's keys; returns the keys."""
    state = pipe.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(value, want.states[step][key], **STATE_TOL,
                                   msg=lambda m, k=key: f"{what}: {k} after step {step}: {m}")
    return set(state)


def _train(pipe: Pipe, case: Case, want: Record, what: str) -> tuple[list[str], list[str]]:
    """`STEPS` AdamW steps of `pipe`, each checked against the unsplit model's (loss, every
    gradient of this rank's parameters, its whole state after the step): the parameter names
    and state keys this rank checked."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    params: set[str] = set()
    keys: set[str] = set()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = _step(pipe, case)
        params |= _check_step(pipe, want, step, loss, what)
        optimizer.step()
        keys |= _check_state(pipe, want, step, what)
    return sorted(params), sorted(keys)


def train_like_the_model(rank: int, name: str, combos: list[tuple[str, str]]
                         ) -> list[tuple[list[str], list[str]]]:
    """Every (schedule, checkpoint) of `combos`: `Pipe(model, example_inputs=...,
    split_points=...)` over the processes trains as the unsplit model does. Returns, per
    combo, the parameter names and state keys this rank checked."""
    case = CASES[name]()
    # The whole batch at once where rows are independent; BatchNorm normalises each
    # micro-batch by its own statistics, so the U-Net's reference runs them in turn.
    want = reference_steps(case, chunks=4 if name == "unet" else None)
    checked = []
    # Each combo's Pipe splits a fresh model; the graph, the same for all, is exported once.
    with exports_reused():
        for schedule, checkpoint in combos:
            pipe = Pipe(case.model(), example_inputs=case.inputs,
                        split_points=split_points(case, schedule), chunks=4,
                        schedule=schedule, checkpoint=checkpoint)
            checked.append(_train(pipe, case, want, f"{name}/{schedule}/{checkpoint}"))
            pipe.close()
    return checked


def _rows(case: Case, rows: int) -> Case:
    """The case on its first `rows` rows (inputs and labels)."""
    inputs = {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
    return Case(case.name, case.build, inputs, case.labels[:rows], case.blocks, case.loss)


def changing_batches(rank: int, runs: list[tuple[str, str, bool]], sizes: list[int]) -> int:
    """Per (model, schedule, labels given to the model) of `runs`: steps on batches of
    `sizes` rows in turn (4 micro-batches: uneven ones, of 1 row, some counting no token), so
    every value crossing the cut (activations, the attention mask, rotary tables, sizes
    carried as empty tensors, the labels) changes shape between steps after the ranks agreed
    on the first shapes. Each step's loss and this rank's gradients equal the unsplit
    model's on the same rows. Returns the steps checked."""
    checked = 0
    for name, schedule, inside in runs:
        case = _labels_inside(CASES[name]()) if inside else CASES[name]()
        weight = _shifted_count if inside else token_count
        reference = case.model()
        pipe = Pipe(case.model(), example_inputs=case.inputs,
                    split_points=split_points(case, schedule), chunks=4, schedule=schedule)
        crossing = pipe.partitions[0][0].outputs["train"]  # the first stage's, on every rank
        assert ("labels" in crossing) == inside, crossing
        for rows in sizes:
            part = _rows(case, rows)
            reference.zero_grad(set_to_none=True)
            expected = part.loss(reference(**part.inputs), part.labels)
            expected.backward()
            pipe.zero_grad(set_to_none=True)
            loss = _step(pipe, part, weight)
            want = Record([expected.detach()],
                          [{n: p.grad for n, p in reference.named_parameters()}])
            _check_step(pipe, want, 0, loss, f"{name}/{schedule}/{inside}/{rows} rows")
            checked += 1
        pipe.close()
    return checked


def _on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _rotary_tables(module: nn.Module) -> None:
    """param_init for a Llama built on the meta device: its weights come from a
    load_state_dict, but its rotary tables (`inv_freq`) are non-persistent buffers no
    state_dict holds, so they are computed here as the model's constructor computes them."""
    if hasattr(module, "inv_freq"):
        fresh = type(module)(module.config)
        for key, value in fresh.named_buffers():
            getattr(module, key).copy_(value)


def _nbytes(tensors: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by every name it has (tied ones twice)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _meta_stage(rank: int, name: str, meta_inputs: bool) -> dict[str, Any]:
    case = CASES[name]()
    reference = case.model()
    with torch.device("meta"):
        skeleton = case.model()
    example = {k: _on_meta(v) for k, v in case.inputs.items()} if meta_inputs else case.inputs
    pipe = Pipe(skeleton, example_inputs=example, split_points=split_points(case, "1f1b"),
                chunks=4, param_init="skip" if name == "gpt2" else _rotary_tables)
    # What this rank's stages hold: the model's tensors they read (a tied weight's copy on
    # the head's rank), under the model's names (after the partition's index).
    held: dict[int, torch.Tensor] = {}
    names: set[str] = set()
    for s in pipe.local_stages:
        for key, t in model_tensors(pipe.partitions[s]).items():
            assert not t.is_meta, f"rank {rank}: {key} was left on the meta device"
            held[id(t)] = t
            if not key.split(".")[1].startswith(("_train_", "_eval_")):  # graph constants
                names.add(key.split(".", 1)[1])
    model = model_tensors(reference)
    found = {
        "held bytes": _nbytes(held),
        "own bytes": _nbytes({id(model[n]): model[n] for n in names}),
        "model bytes": _nbytes({id(t): t for t in model.values()}),
        "names": sorted(names),
        "still meta": sorted(k for k, t in model_tensors(skeleton).items() if t.is_meta),
    }
    pipe.load_state_dict(reference.state_dict())
    first, last = _ends(pipe)
    out = pipe(case.inputs if first else None)
    if last:  # 4 micro-batches against one batch: summation order only
        torch.testing.assert_close(out.logits, reference(**case.inputs).logits, **TOL)
    else:
        assert out is None
    _train(pipe, case, reference_steps(case), f"{name} built on meta")
    pipe.close()
    return found


def meta_stage(rank: int, runs: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Per (model, trace from meta inputs) of `runs`: build the model on the meta device,
    split it (traced from meta inputs, or real ones), materialise only this rank's stage,
    load the unsplit model's state_dict, infer and train as that model does. Returns what
    this rank held: the bytes of its stages' real tensors, of the unsplit model's tensors by
    the names they hold, of the whole model; those names; the skeleton's names still on
    the meta device."""
    return [_meta_stage(rank, name, meta_inputs) for name, meta_inputs in runs]


def _gpt2_pipe(case: Case, point: str) -> Pipe:
    return Pipe(case.model(), example_inputs=case.inputs, split_points=[point], chunks=4)


def save_and_gather(rank: int, path: str) -> tuple[bytes, bytes | None]:
    """GPT-2 split at its third block: one AdamW step, then a sharded checkpoint and the
    whole state_dict gathered on rank 0 (checked there against the unsplit model's after the
    same step), and the unsplit model's state_dict loaded into a fresh Pipe on every rank.
    Returns (this rank's state as saved, packed; the gathered state_dict on rank 0, packed)."""
    case = gpt2_case()
    want = reference_steps(case)
    pipe = _gpt2_pipe(case, case.blocks[2])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _step(pipe, case)
    optimizer.step()
    pipe.save(path, optimizer)
    saved = pack(snapshot(pipe, optimizer))
    full = pipe.full_state_dict(dst=0)
    if rank == 0:
        assert full is not None
        # The model's keys (in stage order: the tied head's key comes with the embedding's).
        assert sorted(full) == sorted(case.model().state_dict())
        for key, value in full.items():
            torch.testing.assert_close(value, want.states[0][key], **STATE_TOL,
                                       msg=lambda m, k=key: f"gathered {k}: {m}")
    else:
        assert full is None
    # Each rank takes its own stage's entries of the whole model's state_dict: rank 0 the
    # tied weight under both keys (its embedding's graph reads it as `lm_head.weight`),
    # rank 1 nothing of it (its head's copy takes the owner's value when a step runs).
    fresh = _gpt2_pipe(case, case.blocks[2])
    fresh.load_state_dict(want.states[0])
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, want.states[0][key]), key
    return saved, pack(full) if full is not None else None


def checkpoint_across_splits(rank: int, path: str) -> tuple[bytes, bytes | None, bytes]:
    """`save_and_gather`, then (every rank's shards written) `load_other_split`, on one set of
    ranks, GPT-2 exported once: both functions' results."""
    with exports_reused():
        saved, full = save_and_gather(rank, path)
        dist.barrier()
        return saved, full, load_other_split(rank, path)


def load_other_split(rank: int, path: str) -> bytes:
    """The checkpoint loaded into GPT-2 split elsewhere (at its second block), with a fresh
    AdamW of another learning rate: this rank's state as loaded (its learning rate the
    saved one), packed."""
    case = gpt2_case()
    pipe = _gpt2_pipe(case, case.blocks[1])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.5)
    pipe.load(path, optimizer)
    return pack(snapshot(pipe, optimizer))
