"""Unmodified models to split from their graphs, from small random configs: GPT-2, Llama, BERT,
BART, T5 and a U-Net, each with its inputs, padded labels and a loss as its users write it."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from pipeline.splitting import trace

__all__ = ["STEPS", "Case", "Record", "UNet", "assert_same_training", "bart_case", "bert_case",
           "exports_reused", "gpt2_case", "llama_case", "pad_labels", "pipe_steps",
           "reference_steps", "t5_case", "token_count", "token_loss", "unet_case"]

VOCAB, CONTEXT, ROWS = 64, 12, 8

# transformers warns that GPT-2's default bos/eos ids (50256) lie outside a small vocabulary;
# they are never used here.
logging.getLogger("transformers").setLevel(logging.ERROR)


@dataclass
class Case:
    """A model and everything a test needs to train it split and unsplit: `inputs` as the
    model is called (a dict of keyword arguments), `labels` with -100 where nothing counts,
    `blocks` the names of its repeated blocks in run order (the natural split points), and
    `loss` as a user writes it for the model's output as the model returns it."""

    name: str
    build: Callable[[float], nn.Module]  # dropout -> a fresh model, the same weights each call
    inputs: dict[str, Any]
    labels: torch.Tensor
    blocks: list[str]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]

    def model(self, dropout: float = 0.0) -> nn.Module:
        return self.build(dropout)


def token_count(target: torch.Tensor) -> torch.Tensor:
    """What a token-averaged loss divides by: the labels not -100 (the loss weight)."""
    return (target != -100).sum()


def token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every counted token of a ModelOutput's logits."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def pad_labels(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The ids as labels, -100 past each row's length (right padding, as a tokenizer pads);
    a length of 0 is a row with nothing to count."""
    labels = ids.clone()
    for row, length in enumerate(lengths):
        labels[row, length:] = -100
    return labels


# Micro-batches of 2 rows (chunks=4 on 8 rows) count 23, 3, 0 and 24 tokens: the third has
# nothing to count (its mean would be 0/0), and row-weighting would train wrong.
_LENGTHS = [12, 11, 3, 0, 0, 0, 12, 12]


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=torch.Generator().manual_seed(seed))


def gpt2_case() -> Case:
    """GPT-2 with its head tied to the token embedding, 4 blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=4, n_head=2,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))
    ids = _ids(1)
    return Case("gpt2", build, {"input_ids": ids, "use_cache": False},
                pad_labels(ids, _LENGTHS), [f"transformer.h.{i}" for i in range(4)], token_loss)


def llama_case() -> Case:
    """Llama with grouped-query attention (4 heads, 2 key/value heads), rotary positions,
    RMSNorm and an untied head, 4 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
            attention_dropout=dropout, tie_word_embeddings=False))
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[3:6, 6:] = 0  # padded rows attend to their prompt only
    return Case("llama", build, {"input_ids": ids, "attention_mask": mask, "use_cache": False},
                pad_labels(ids, _LENGTHS), [f"model.layers.{i}" for i in range(4)], token_loss)


def bert_case() -> Case:
    """BERT for masked LM: its decoder tied to the word embedding, segment ids (token_type_ids)
    and an attention mask, 4 layers; labels only at the masked positions."""
    from transformers import BertConfig, BertForMaskedLM

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=CONTEXT, type_vocab_size=2,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
    ids = _ids(3)
    segments = torch.zeros_like(ids)
    segments[:, CONTEXT // 2:] = 1
    mask = torch.ones_like(ids)
    mask[:, 10:] = 0
    masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.3
    labels = torch.where(masked & (mask == 1), ids, torch.full_like(ids, -100))
    labels[4:6] = -100  # a micro-batch with no masked token
    labels[0, 0] = ids[0, 0]  # at least one counted token per other micro-batch
    labels[2, 0], labels[6, 0] = ids[2, 0], ids[6, 0]
    return Case("bert", build, {"input_ids": ids, "token_type_ids": segments,
                                "attention_mask": mask},
                labels, [f"bert.encoder.layer.{i}" for i in range(4)], token_loss)


def _seq2seq_inputs(seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Encoder ids with a padded tail, decoder ids and their labels (another length than the
    encoder's), as a seq2seq collator gives them."""
    ids = _ids(seed)
    mask = torch.ones_like(ids)
    mask[2:5, 7:] = 0
    targets = torch.randint(0, VOCAB, (ROWS, CONTEXT - 4),
                            generator=torch.Generator().manual_seed(seed + 100))
    decoder_ids = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], dim=1)
    labels = pad_labels(targets, [8, 7, 3, 0, 0, 0, 8, 8])
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids,
            "use_cache": False}, labels


def bart_case() -> Case:
    """BART: an encoder and a decoder sharing the token embedding (tied to the head too),
    learned positions and embedding LayerNorms on both sides, 2 + 2 layers. Its split points
    put the encoder's output and the decoder's embeddings in one stage, on separate branches."""
    from transformers import BartConfig, BartForConditionalGeneration

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return BartForConditionalGeneration(BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=CONTEXT, dropout=dropout,
            attention_dropout=dropout, activation_dropout=dropout, pad_token_id=1,
            bos_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=None))
    inputs, labels = _seq2seq_inputs(5)
    return Case("bart", build, inputs, labels,
                ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
                 "model.decoder.layers.1"], token_loss)


def t5_case() -> Case:
    """T5: relative position biases made in each stack's first block and handed to the others
    (a value that depends on no activation, crossing stages), the shared embedding tied to
    the head, 2 + 2 blocks."""
    from transformers import T5Config, T5ForConditionalGeneration

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
            dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0,
            tie_word_embeddings=True))
    inputs, labels = _seq2seq_inputs(6)
    return Case("t5", build, inputs, labels,
                ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
                token_loss)


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """A two-level U-Net: each decoder level concatenates the encoder's features of its
    resolution (skip connections, so a cut between `enc1` and `dec1` carries `enc1`'s output
    across every stage in between), BatchNorm after every convolution; returns a dict of the
    per-pixel logits and the bottleneck's features."""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        c = channels
        self.enc1 = _conv(3, c)
        self.enc2 = _conv(c, 2 * c)
        self.mid = _conv(2 * c, 2 * c)
        self.dec2 = _conv(4 * c, c)
        self.dec1 = _conv(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        e1 = self.enc1(images)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        bottom = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(bottom, scale_factor=2.0), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1))
        return {"logits": self.head(d1), "features": bottom}


def _pixel_loss(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"], target, ignore_index=-100)


def unet_case() -> Case:
    """The U-Net on 8 images of 8x8, labels per pixel, -100 outside each image's region."""
    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return UNet()
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(ROWS, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 3, (ROWS, 8, 8), generator=gen)
    # Micro-batches of 2 images count 104, 0, 72 and 72 pixels: the second counts none, yet
    # its forward still moves BatchNorm's running statistics.
    for row, width in enumerate([8, 5, 0, 0, 8, 1, 3, 6]):
        labels[row, :, width:] = -100  # unlabelled columns
    return Case("unet", build, {"images": images}, labels,
                ["enc1", "enc2", "mid", "dec2", "dec1"], _pixel_loss)


# Exporting once: a sweep builds the same model many times, and each Pipe over it exports it
# twice (training and eval graphs), a second or more each: most of a Pipe's set-up.

_EXPORTS: dict[Any, torch.export.ExportedProgram] = {}


def _export_key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool,
                preserve: Any) -> Any:
    """What an exported graph depends on: the model's class and structure (its repr names
    every module and size), where its tensors live, the mode, the modules kept whole, and
    the inputs (their structure, and each tensor's shape, dtype, device and values)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    inputs = tuple((tuple(v.shape), v.dtype, v.device.type,
                    None if v.is_meta else v.cpu().numpy().tobytes())
                   if isinstance(v, torch.Tensor) else repr(v) for v in leaves)
    where = sorted({(t.device.type, t.dtype) for t in [*model.parameters(), *model.buffers()]},
                   key=repr)
    return (type(model), repr(model), repr(where), train, tuple(preserve), str(spec), inputs)


@contextlib.contextmanager
def exports_reused() -> Iterator[None]:
    """Within it, `Pipe(model, example_inputs=...)` and `pipeline.split` export a model once
    per structure, mode and inputs (`_export_key`), and every later model built alike gets
    its own copy of that graph: the graph holds no value of the model (its weights are
    placeholders, bound to each model's own tensors by name when it is cut). Everything
    after the export (cutting, placing the model's tensors in the stages, compiling them,
    the Pipe) runs for each model as it would. For sweeps of one model over schedules and
    modes, where exporting the same graph again checks nothing new."""
    export = trace.export

    def reused(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
               train: bool, preserve: Any = ()) -> torch.export.ExportedProgram:
        key = _export_key(model, args, kwargs, train, preserve)
        if key not in _EXPORTS:
            _EXPORTS[key] = export(model, args, kwargs, train=train, preserve=preserve)
        with warnings.catch_warnings():  # torch's own pytree deprecation, inside deepcopy
            warnings.simplefilter("ignore", FutureWarning)
            # A copy each time: splitting may rewrite the graph (modules kept whole).
            return copy.deepcopy(_EXPORTS[key])

    trace.export = reused  # type: ignore[assignment]
    try:
        yield
    finally:
        trace.export = export  # type: ignore[assignment]


# Training: the unsplit model's steps and a Pipe's, recorded alike and compared.

STEPS = 3  # AdamW steps: the second and third start from weights the first steps moved
LR = 1e-3


@dataclass
class Record:
    """Per step: the loss, every parameter's gradient and, after the optimizer's step, the whole
    state_dict (parameters and buffers: BatchNorm's running statistics)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def add(self, loss: torch.Tensor, model: nn.Module) -> None:
        self.losses.append(loss.detach().clone())
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None})

    def after_step(self, model: nn.Module) -> None:
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def reference_steps(case: Case, chunks: int | None = None) -> Record:
    """`STEPS` AdamW steps of the unsplit model on the case's batch. `chunks=None`: the whole
    batch at once. `chunks=k`: the model run on each of k micro-batches in turn (as a pipeline
    runs them), each one's loss weighted by its share of the batch's counted labels and its
    backward taken alone, a micro-batch counting nothing skipped (its mean is 0/0) though its
    forward runs. Both give the same gradients for a model whose rows are independent; with
    BatchNorm in training mode only the second is what a pipeline computes, since each
    micro-batch is normalised by its own statistics (and updates the running ones in turn)."""
    model = case.model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    record = Record()
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if chunks is None:
            loss = case.loss(model(**case.inputs), case.labels)
            loss.backward()
        else:
            total = token_count(case.labels)
            loss = torch.zeros(())
            parts = {k: torch.tensor_split(v, chunks) if isinstance(v, torch.Tensor) else
                     [v] * chunks for k, v in case.inputs.items()}
            for m, labels in enumerate(torch.tensor_split(case.labels, chunks)):
                out = model(**{k: v[m] for k, v in parts.items()})
                count = token_count(labels)
                if count == 0:
                    continue
                part = case.loss(out, labels) * (count / total)
                part.backward()
                loss = loss + part.detach()
        record.add(loss, model)
        optimizer.step()
        record.after_step(model)
    return record


def pipe_steps(pipe: nn.Module, model: nn.Module, case: Case) -> Record:
    """`STEPS` AdamW steps of `pipe` (over `model`'s tensors), the optimizer built on
    `model.parameters()`: the model's own Parameters are the Pipe's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    record = Record()
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        record.add(loss, model)
        optimizer.step()
        record.after_step(model)
    return record


def assert_same_training(got: Record, want: Record) -> None:
    """Equal losses, gradients and states, step by step, to fp32 rounding: the pipeline adds
    micro-batch losses and gradients in another order than one batch's reductions (rtol 1e-5;
    atol 1e-6 for values that are zero in exact arithmetic and come out as rounding noise).
    States get atol 1e-5: AdamW moves a weight by lr x g / (|g| + 1e-8) per step, so a noise
    gradient moves it by up to lr x noise / 1e-8. The noise gradients here are BERT's attention
    key biases (softmax ignores them; ~1e-12, moving them ~1e-7) and the U-Net's convolution
    biases before BatchNorm (~1e-9, but its reference runs the same micro-batches through the
    same ops: equal bit for bit). Measured, the largest difference after 3 steps is 8e-7."""
    for step in range(STEPS):
        torch.testing.assert_close(got.losses[step], want.losses[step], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"loss of step {step}: {m}")
        assert got.grads[step].keys() == want.grads[step].keys(), f"step {step}"
        for key, grad in want.grads[step].items():
            torch.testing.assert_close(got.grads[step][key], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, s=step: f"grad {k}, step {s}: {m}")
        assert got.states[step].keys() == want.states[step].keys(), f"step {step}"
        for key, value in want.states[step].items():
            torch.testing.assert_close(got.states[step][key], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=key, s=step: f"{k} after step {s}: {m}")
