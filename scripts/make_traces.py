#!/usr/bin/env python3
"""Make the bundled allocation traces in benchmarks/traces/ from real models.

    python scripts/make_traces.py [--out benchmarks/traces] [--steps N] [WORKLOAD ...]

Each trace is a real PyTorch workload run on the CPU under
torch.profiler.profile(profile_memory=True). The profiler records every
allocation and free of PyTorch's CPU allocator with its address and size
(+bytes for an allocation, -bytes for a free); those events, in time order,
become cotenant's JSON-lines trace format (addresses become ids; a new id per
allocation, since addresses are reused), gzipped. The model, its optimizer
and its inputs are created inside the profiled region so their allocations
are in the trace too.

Each pass of a workload's loop runs inside `iteration()`, a profiler range;
where the range ends the trace gets an {"op": "iteration"} line, so a replay
can tell a loop's first, cold pass from its warm ones. The first line of a
trace is a "meta" record: what the workload is, the command, the torch
version, the loop's steps and the number of iteration marks.

Workloads (an iteration is one pass of the loop named in brackets):
  resnet_train       a ResNet-style CNN (basic blocks, 4 stages), SGD with momentum
                     [training step]
  gpt_train          a GPT-style decoder-only transformer, AdamW [training step]
  gpt_generate       the same transformer generating tokens with a KV cache that
                     grows by concatenation [generated token]
  gpt_train_varlen   gpt_train with length-bucketed batches: each step's sequence
                     length is drawn from a distribution of document lengths and its
                     batch fills a fixed token budget [training step]
  gpt_train_buckets  gpt_train with batches padded to one of three bucket lengths
                     (64, 128, 256 tokens), drawn at random each step, each batch
                     2048 tokens: a loop that cycles through a few step shapes
                     [training step]
  resnet_multiscale  an ImageNet-style ResNet trained at a different input
                     resolution each step, 160..320 in steps of 32, in shuffled
                     rounds of every scale [training step]
  moe_train          a transformer whose MLPs are mixtures of experts with top-2
                     routing: each expert gets a different number of tokens each
                     step [training step]
  serve_varbatch     the GPT serving requests one after another, each of its own
                     batch size, prompt length and generation length, with a KV
                     cache preallocated per request (prefill, then decode) [request]
  detection_train    an FCOS-style detector (ResNet backbone, FPN neck, shared heads)
                     on images of varying size with a varying number of boxes each;
                     the loss assigns locations to boxes [training step]

Not bundled, made only when named (compared with the GPT run recorded on an
H100 in docs/allocator.md, "On real runs"): gpt_recorded_program and
gpt_recorded_program_fp32, that recorded program (record_snapshots.py) on
the CPU in bfloat16 mixed precision and in float32; gpt_train_lengths and
gpt_train_lengths_bf16, this script's GPT on the recording's shapes.

Shapes are drawn from random.Random(SHAPE_SEED) and data from torch's generator
seeded with 0, on one CPU thread, so a run gives the same traces byte for byte
on the same machine and torch build.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

SHAPE_SEED = 0

# ---- the models -------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """Four stages of basic blocks, each after the first halving the resolution.
    The CIFAR stem keeps the input resolution; the ImageNet stem (a strided 7x7
    convolution and a max pool) divides it by 4."""

    def __init__(self, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), classes=100, imagenet_stem=False):
        super().__init__()
        if imagenet_stem:
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, inputs = [], widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            layers = []
            for i in range(count):
                layers.append(BasicBlock(inputs, width, 2 if (i == 0 and stage > 0) else 1))
                inputs = width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(inputs, classes)

    def features(self, x) -> List[torch.Tensor]:
        """The output of each stage, finest first."""
        outputs = []
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
            outputs.append(x)
        return outputs

    def forward(self, x):
        x = self.features(x)[-1]
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class GrowingKVCache:
    """Keys and values of the tokens so far; each step concatenates the new
    ones, so every token allocates a new, longer tensor per layer."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)
            v = torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class PreallocatedKVCache:
    """Keys and values in buffers sized for a whole request (prompt plus
    generation), allocated once and filled in place, as servers do."""

    def __init__(self, batch: int, heads: int, length: int, head_width: int):
        self.k = torch.empty(batch, heads, length, head_width)
        self.v = torch.empty(batch, heads, length, head_width)
        self.length = 0

    def append(self, k, v):
        end = self.length + k.shape[2]
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, cache=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        # A prefill (t > 1) starts at position 0, so causal masking lines up; one decoded token sees all keys.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or t > 1)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


def mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MixtureOfExperts(nn.Module):
    """A router sends each token to its top_k experts (MLPs); an expert runs
    on the tokens sent to it, however many that is this step, and their
    outputs are summed back weighted by the router's renormalized
    probabilities. balance_loss (Switch Transformer's auxiliary loss) is left
    on the module by each forward for the training loop to add."""

    def __init__(self, width: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(mlp(width, hidden) for _ in range(experts))
        self.balance_loss = torch.zeros(())

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        probabilities = F.softmax(self.router(tokens), dim=-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        output = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token_rows, slots = torch.where(chosen == index)
            if token_rows.numel() == 0:
                continue
            output.index_add_(0, token_rows, expert(tokens[token_rows]) * weights[token_rows, slots, None])
        experts = len(self.experts)
        first_choice_share = F.one_hot(chosen[:, 0], experts).float().mean(dim=0)
        self.balance_loss = experts * (first_choice_share * probabilities.mean(dim=0)).sum()
        return output.view(b, t, c)


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, feed_forward: Optional[nn.Module] = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = feed_forward if feed_forward is not None else mlp(width, 4 * width)

    def forward(self, x, cache=None):
        x = x + self.attention(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """feed_forward(width) makes each block's MLP (default: width -> 4 width -> width)."""

    def __init__(self, vocabulary=8192, width=384, heads=6, depth=6, context=256,
                 feed_forward: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        self.heads = heads
        self.token = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            TransformerBlock(width, heads, feed_forward(width) if feed_forward else None) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens, caches=None, start=0):
        positions = torch.arange(start, start + tokens.shape[1])
        x = self.token(tokens) + self.position(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln(x))


class FeaturePyramid(nn.Module):
    """FPN neck: 1x1 lateral convolutions to one width, a top-down pass adding
    each coarser level (upsampled) to the next finer one, and a 3x3
    convolution per level."""

    def __init__(self, input_widths, width: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(w, width, 1) for w in input_widths)
        self.output = nn.ModuleList(nn.Conv2d(width, width, 3, 1, 1) for _ in input_widths)

    def forward(self, features):
        levels = [lateral(f) for lateral, f in zip(self.lateral, features)]
        for i in range(len(levels) - 2, -1, -1):
            levels[i] = levels[i] + F.interpolate(levels[i + 1], size=levels[i].shape[-2:], mode="nearest")
        return [output(level) for output, level in zip(self.output, levels)]


class DetectionHead(nn.Module):
    """FCOS head, shared by every pyramid level: a classification tower giving
    class logits and centerness, a box tower giving the distances (pixels /
    stride) from a location to its box's left, top, right and bottom sides."""

    def __init__(self, width: int, classes: int):
        super().__init__()

        def tower():
            return nn.Sequential(nn.Conv2d(width, width, 3, 1, 1), nn.GroupNorm(16, width), nn.ReLU(),
                                 nn.Conv2d(width, width, 3, 1, 1), nn.GroupNorm(16, width), nn.ReLU())

        self.class_tower, self.box_tower = tower(), tower()
        self.classify = nn.Conv2d(width, classes, 3, 1, 1)
        self.centerness = nn.Conv2d(width, 1, 3, 1, 1)
        self.box = nn.Conv2d(width, 4, 3, 1, 1)

    def forward(self, level):
        c, b = self.class_tower(level), self.box_tower(level)
        return self.classify(c), self.centerness(c), F.relu(self.box(b))


class Detector(nn.Module):
    """ResNet backbone (strides 8, 16, 32 used), FPN neck, FCOS head. forward
    gives per image (locations, 1 + classes + 4) rows of every level: class
    logits, centerness logit, box distances in pixels."""

    STRIDES = (8, 16, 32)

    def __init__(self, classes=20, width=64):
        super().__init__()
        self.backbone = ResNet(widths=(32, 64, 128, 256), blocks=(1, 1, 1, 1), imagenet_stem=True)
        self.neck = FeaturePyramid((64, 128, 256), width)
        self.head = DetectionHead(width, classes)

    def forward(self, images):
        rows = []
        for stride, level in zip(self.STRIDES, self.neck(self.backbone.features(images)[1:])):
            logits, centerness, box = self.head(level)
            per_location = torch.cat([logits, centerness, box * stride], dim=1)
            rows.append(per_location.flatten(2).transpose(1, 2))
        return torch.cat(rows, dim=1)


# ---- the detection loss -------------------------------------------------------------

# FCOS hands each pyramid level the objects whose largest side distance falls in its range (pixels).
LEVEL_RANGES = ((0.0, 64.0), (64.0, 128.0), (128.0, math.inf))


def location_grid(height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Centres (x, y) in pixels of every location of every level, in the
    order Detector.forward gives them, and each location's (low, high) range."""
    centres, ranges = [], []
    for stride, (low, high) in zip(Detector.STRIDES, LEVEL_RANGES):
        ys = torch.arange(math.ceil(height / stride)) * stride + stride // 2
        xs = torch.arange(math.ceil(width / stride)) * stride + stride // 2
        y, x = torch.meshgrid(ys, xs, indexing="ij")
        centres.append(torch.stack([x.flatten(), y.flatten()], dim=1).float())
        ranges.append(torch.tensor([low, high]).expand(centres[-1].shape[0], 2))
    return torch.cat(centres), torch.cat(ranges)


def detection_loss(rows, boxes: List[torch.Tensor], labels: List[torch.Tensor], centres, ranges):
    """FCOS loss. Each location is assigned the smallest box that contains it
    within its level's range; the (locations x boxes) matching, the positives
    and the regression targets all change size with the boxes of the image."""
    classes = rows.shape[2] - 5
    x, y = centres[:, 0:1], centres[:, 1:2]
    total = rows.new_zeros(())
    for image_rows, image_boxes, image_labels in zip(rows, boxes, labels):
        sides = torch.stack([x - image_boxes[:, 0], y - image_boxes[:, 1],
                             image_boxes[:, 2] - x, image_boxes[:, 3] - y], dim=2)  # (locations, boxes, 4)
        largest = sides.max(dim=2).values
        fits = (sides.min(dim=2).values > 0) & (largest >= ranges[:, 0:1]) & (largest <= ranges[:, 1:2])
        areas = ((image_boxes[:, 2] - image_boxes[:, 0]) * (image_boxes[:, 3] - image_boxes[:, 1])).expand_as(largest)
        smallest_area, matched = torch.where(fits, areas, torch.full_like(areas, math.inf)).min(dim=1)
        positive = torch.nonzero(smallest_area < math.inf).squeeze(1)
        targets = torch.zeros(image_rows.shape[0], classes)
        targets[positive, image_labels[matched[positive]]] = 1.0
        normalizer = max(1, positive.numel())
        total = total + sigmoid_focal_loss(image_rows[:, :classes], targets) / normalizer
        if positive.numel() == 0:
            continue
        target_sides = sides[positive, matched[positive]]
        predicted_sides = image_rows[positive, classes + 1:]
        total = total + (1.0 - box_iou(predicted_sides, target_sides)).sum() / normalizer
        left_right, top_bottom = target_sides[:, 0::2], target_sides[:, 1::2]
        centerness = torch.sqrt((left_right.min(dim=1).values / left_right.max(dim=1).values)
                                * (top_bottom.min(dim=1).values / top_bottom.max(dim=1).values))
        total = total + F.binary_cross_entropy_with_logits(image_rows[positive, classes], centerness)
    return total / len(boxes)


def sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0):
    probability = torch.sigmoid(logits)
    cross_entropy = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = probability * targets + (1 - probability) * (1 - targets)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * (1 - p_t) ** gamma * cross_entropy).sum()


def box_iou(predicted, target):
    """IoU of boxes given as (left, top, right, bottom) distances from the same point."""
    area_p = (predicted[:, 0] + predicted[:, 2]) * (predicted[:, 1] + predicted[:, 3])
    area_t = (target[:, 0] + target[:, 2]) * (target[:, 1] + target[:, 3])
    overlap_w = torch.min(predicted[:, 0], target[:, 0]) + torch.min(predicted[:, 2], target[:, 2])
    overlap_h = torch.min(predicted[:, 1], target[:, 1]) + torch.min(predicted[:, 3], target[:, 3])
    overlap = overlap_w * overlap_h
    return overlap / (area_p + area_t - overlap + 1e-6)


def random_boxes(rng: random.Random, count: int, height: int, width: int, classes: int):
    """count boxes (x0, y0, x1, y1) in pixels, sides 16 px to half the image, and their labels."""
    rows = []
    for _ in range(count):
        w = rng.uniform(16, width / 2)
        h = rng.uniform(16, height / 2)
        x0 = rng.uniform(0, width - w)
        y0 = rng.uniform(0, height - h)
        rows.append((x0, y0, x0 + w, y0 + h))
    return torch.tensor(rows), torch.randint(0, classes, (count,))


# ---- the workloads ----------------------------------------------------------------


ITERATION_MARK = "cotenant::iteration"


def iteration():
    """Brackets one pass of a workload's loop; the trace gets an
    {"op": "iteration"} where the pass ends."""
    return record_function(ITERATION_MARK)


def train_step(optimizer, loss):
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def resnet_train(steps: int, rng: random.Random):
    model = ResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(steps):
        with iteration():
            images = torch.randn(32, 3, 32, 32)
            labels = torch.randint(0, 100, (32,))
            train_step(optimizer, F.cross_entropy(model(images), labels))


def train_gpt(steps: int, batch_shape: Callable[[], Tuple[int, int]]):
    """GPT training with AdamW; each step's (sequences, length) from
    batch_shape(), drawn inside the step."""
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        with iteration():
            batch, length = batch_shape()
            tokens = torch.randint(0, 8192, (batch, length + 1))
            logits = model(tokens[:, :-1])
            train_step(optimizer, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def gpt_train(steps: int, rng: random.Random):
    train_gpt(steps, lambda: (8, 256))


def gpt_generate(steps: int, rng: random.Random):
    """steps sequences of 4, each a 32-token prompt extended to 160 tokens."""
    model = GPT().eval()
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.randint(0, 8192, (4, 32))
            caches = [GrowingKVCache() for _ in model.blocks]
            with iteration():
                logits = model(tokens, caches)
            for position in range(tokens.shape[1], 160):
                with iteration():
                    next_token = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
                    tokens = torch.cat([tokens, next_token], dim=1)
                    logits = model(next_token, caches, start=position)


def document_length(rng: random.Random, shortest: int, longest: int) -> int:
    """A document length in tokens: log-normal with median 96, clipped."""
    return max(shortest, min(longest, round(rng.lognormvariate(math.log(96), 0.8))))


def gpt_train_varlen(steps: int, rng: random.Random):
    """Length-bucketed batches: a bucket's sequence length is a drawn document
    length, its batch as many sequences as fit in 1024 tokens."""
    def shape() -> Tuple[int, int]:
        length = document_length(rng, 8, 256)
        return max(1, 1024 // length), length

    train_gpt(steps, shape)


def gpt_train_buckets(steps: int, rng: random.Random):
    """Batches padded to a bucket length (64, 128 or 256 tokens, at random),
    2048 tokens each: the loop's steps come in three shapes, in any order."""
    def shape() -> Tuple[int, int]:
        length = rng.choice((64, 128, 256))
        return 2048 // length, length

    train_gpt(steps, shape)


# The GPT training run recorded on an H100 (benchmarks/record_snapshots.py,
# gpt_train_varlen: batch 8, sequence length 64..512 in steps of 64, width
# 512, 6 layers, AdamW), made on the CPU: that program itself, and this
# script's GPT on the same shapes; each in bfloat16 mixed precision, as
# recorded, and in float32, as the bundled traces are. Not bundled: they
# compare the CPU's traces with the recording (docs/allocator.md, "On real runs").
RECORDED_LENGTHS = tuple(range(64, 513, 64))
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def recorded_gpt(steps: int, mixed_precision: bool):
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import record_snapshots  # the recorder: its program, run here on the CPU

    _, step = record_snapshots.gpt_train_varlen(torch, "cpu", mixed_precision=mixed_precision)
    for _ in range(steps):
        with iteration():
            step()


def gpt_train_lengths(steps: int, rng: random.Random, mixed_precision: bool):
    model = GPT(width=512, heads=8, context=max(RECORDED_LENGTHS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        with iteration():
            tokens = torch.randint(0, 8192, (8, rng.choice(RECORDED_LENGTHS) + 1))
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()


def resnet_multiscale(steps: int, rng: random.Random):
    """Resolutions come in rounds, each every scale of 160..320 (step 32)
    once in a shuffled order, so every scale is trained on as often."""
    scales = list(range(160, 321, 32))
    rounds = [rng.sample(scales, len(scales)) for _ in range(math.ceil(steps / len(scales)))]
    resolutions = [resolution for round_ in rounds for resolution in round_][:steps]
    model = ResNet(widths=(32, 64, 128, 256), imagenet_stem=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for resolution in resolutions:
        with iteration():
            images = torch.randn(8, 3, resolution, resolution)
            labels = torch.randint(0, 100, (8,))
            train_step(optimizer, F.cross_entropy(model(images), labels))


def moe_train(steps: int, rng: random.Random):
    model = GPT(vocabulary=4096, width=256, heads=4, depth=4, context=128,
                feed_forward=lambda width: MixtureOfExperts(width, 2 * width, experts=8, top_k=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        with iteration():
            tokens = torch.randint(0, 4096, (8, 129))
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            balance = sum(block.mlp.balance_loss for block in model.blocks)
            train_step(optimizer, loss + 0.01 * balance)


def serve_varbatch(steps: int, rng: random.Random):
    """steps request batches, one after another: batch 1..16, prompt 16..192
    tokens, 8..64 generated tokens (greedy), prompt + generation <= 256."""
    model = GPT().eval()
    head_width = model.head.in_features // model.heads
    with torch.no_grad():
        for _ in range(steps):
            with iteration():
                batch = rng.randint(1, 16)
                prompt = rng.randint(16, 192)
                generate = rng.randint(8, min(64, 256 - prompt))
                tokens = torch.randint(0, 8192, (batch, prompt))
                caches = [PreallocatedKVCache(batch, model.heads, prompt + generate, head_width) for _ in model.blocks]
                logits = model(tokens, caches)
                for position in range(prompt, prompt + generate - 1):
                    next_token = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
                    logits = model(next_token, caches, start=position)
                del caches, logits, tokens  # a finished request's KV cache goes before the next one's comes


def detection_train(steps: int, rng: random.Random):
    """Batches of 4 images of one drawn size (sides 256..512 in steps of
    32), each with 1..30 boxes."""
    classes = 20
    model = Detector(classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    for _ in range(steps):
        with iteration():
            height, width = rng.randrange(256, 513, 32), rng.randrange(256, 513, 32)
            images = torch.randn(4, 3, height, width)
            targets = [random_boxes(rng, rng.randint(1, 30), height, width, classes) for _ in range(4)]
            centres, ranges = location_grid(height, width)
            rows = model(images)
            loss = detection_loss(rows, [t[0] for t in targets], [t[1] for t in targets], centres, ranges)
            train_step(optimizer, loss)


@dataclass(frozen=True)
class Workload:
    run: Callable[[int, random.Random], None]
    steps: int  # passes of its loop by default
    what: str  # for the meta record
    bundled: bool = True  # made by default, into benchmarks/traces; else only when named


WORKLOADS: Dict[str, Workload] = {
    "resnet_train": Workload(resnet_train, 8, "ResNet-18-style CNN training on 32x32 images, batch 32, SGD; "
                                              "iteration = training step"),
    "gpt_train": Workload(gpt_train, 8, "GPT (6 layers, width 384) training, batch 8 x 256 tokens, AdamW; "
                                        "iteration = training step"),
    "gpt_generate": Workload(gpt_generate, 3, "GPT greedy generation, batch 4, 32-token prompts to 160 tokens, "
                                              "KV cache grown by concatenation; iteration = generated token"),
    "gpt_train_varlen": Workload(gpt_train_varlen, 16, "GPT training on length-bucketed batches, sequence length "
                                                       "log-normal (median 96, 8..256), batch = 1024 tokens / length; "
                                                       "iteration = training step"),
    "gpt_train_buckets": Workload(gpt_train_buckets, 24, "GPT training on batches padded to bucket lengths "
                                                         "64, 128 or 256 tokens at random, 2048 tokens a batch; "
                                                         "iteration = training step"),
    "resnet_multiscale": Workload(resnet_multiscale, 16, "ResNet (widths 32..256, ImageNet stem) multi-scale "
                                                         "training, batch 8, resolution 160..320 step 32 in "
                                                         "shuffled rounds; iteration = training step"),
    "moe_train": Workload(moe_train, 12, "transformer (4 layers, width 256) with 8-expert top-2 MoE MLPs, batch "
                                         "8 x 128 tokens, AdamW; iteration = training step"),
    "serve_varbatch": Workload(serve_varbatch, 16, "GPT serving request batches one after another, batch 1..16, "
                                                   "prompt 16..192, 8..64 new tokens, KV cache preallocated per "
                                                   "request; iteration = request batch"),
    "detection_train": Workload(detection_train, 16, "FCOS-style detector (ResNet backbone, FPN, shared head) "
                                                     "training, 4 images of 256..512 px sides, 1..30 boxes each, "
                                                     "SGD; iteration = training step"),
    "gpt_recorded_program": Workload(
        lambda steps, rng: recorded_gpt(steps, mixed_precision=True), 30,
        "record_snapshots.py's gpt_train_varlen (the H100 recording's program) on the CPU, bfloat16 autocast, "
        "batch 8 x 64..512 tokens; iteration = training step", bundled=False),
    "gpt_recorded_program_fp32": Workload(
        lambda steps, rng: recorded_gpt(steps, mixed_precision=False), 30,
        "record_snapshots.py's gpt_train_varlen on the CPU in float32, batch 8 x 64..512 tokens; "
        "iteration = training step", bundled=False),
    "gpt_train_lengths": Workload(
        lambda steps, rng: gpt_train_lengths(steps, rng, mixed_precision=False), 30,
        "GPT (6 layers, width 512) training in float32 on the recording's shapes, batch 8 x 64..512 tokens, "
        "AdamW; iteration = training step", bundled=False),
    "gpt_train_lengths_bf16": Workload(
        lambda steps, rng: gpt_train_lengths(steps, rng, mixed_precision=True), 30,
        "GPT (6 layers, width 512) training under bfloat16 autocast on the recording's shapes, batch 8 x "
        "64..512 tokens, AdamW; iteration = training step", bundled=False),
}


# ---- profiler events -> trace -----------------------------------------------------

# On a tie in time a free goes first (an address is only reused after its
# free), and an iteration mark last (a pass ends after what it timed).
FREE, ALLOC, MARK = 0, 1, 2


def trace_events(prof):
    """(time ns, kind, address, bytes) of every CPU allocator event and every
    iteration's end, in time order; kind is FREE, ALLOC or MARK."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if str(fields.device) == "cpu" and fields.alloc_size != 0:
                kind = ALLOC if fields.alloc_size > 0 else FREE
                events.append((node.start_time_ns, kind, fields.ptr, fields.alloc_size))
        elif node.name == ITERATION_MARK:
            events.append((node.end_time_ns, MARK, None, 0))
        stack.extend(node.children)
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def to_trace_lines(events, meta):
    """Trace records: a fresh id per allocation; frees of addresses allocated
    before profiling began are dropped (counted in meta)."""
    lines = [meta]
    live = {}  # address -> id
    next_id = 1
    dropped_frees = 0
    iterations = 0
    for _, kind, address, size in events:
        if kind == MARK:
            lines.append({"op": "iteration"})
            iterations += 1
        elif kind == ALLOC:
            if address in live:  # a free the profiler missed: the address was reused
                lines.append({"op": "free", "id": live.pop(address)})
            live[address] = next_id
            lines.append({"op": "alloc", "id": next_id, "size": size, "stream": 0})
            next_id += 1
        elif address in live:
            lines.append({"op": "free", "id": live.pop(address)})
        else:
            dropped_frees += 1
    meta["iterations"] = iterations
    meta["dropped_frees_of_earlier_allocations"] = dropped_frees
    meta["live_at_end"] = len(live)
    return lines


def make_trace(name: str, steps: Optional[int], out_dir: str) -> str:
    workload = WORKLOADS[name]
    steps = workload.steps if steps is None else steps
    torch.manual_seed(0)
    rng = random.Random(SHAPE_SEED)
    started = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        workload.run(steps, rng)
    events = trace_events(prof)
    meta = {
        "op": "meta",
        "trace": name,
        "workload": workload.what,
        "source": "torch.profiler.profile(activities=[CPU], profile_memory=True) allocation events, "
                  f"iteration marks where a '{ITERATION_MARK}' profiler range ends",
        "command": f"python scripts/make_traces.py --steps {steps} {name}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seeds": {"torch": 0, "shapes": SHAPE_SEED},
        "steps": steps,
    }
    lines = to_trace_lines(events, meta)
    path = os.path.join(out_dir, f"{name}.jsonl.gz")
    # mtime=0: the same run gives the same bytes.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        for record in lines:
            f.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
    print(f"{path}: {len(lines) - 1} ops ({meta['iterations']} iterations), "
          f"{os.path.getsize(path) / 1024:.0f} KiB, {time.time() - started:.0f} s", file=sys.stderr)
    return path


def bundled_workloads() -> List[str]:
    """The workloads whose traces are bundled in benchmarks/traces/."""
    return [name for name, workload in WORKLOADS.items() if workload.bundled]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "benchmarks", "traces"))
    parser.add_argument("--steps", type=int, default=None,
                        help="passes of each workload's loop (training steps, generated sequences, request "
                             "batches); default: each workload's own")
    bundled = bundled_workloads()
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"which to make (default: the bundled ones, {', '.join(bundled)}; "
                             f"also: {', '.join(name for name in WORKLOADS if name not in bundled)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {unknown[0]}; choose from {', '.join(WORKLOADS)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    torch.set_num_threads(1)  # one thread: the allocation sequence does not depend on the machine's cores
    os.makedirs(args.out, exist_ok=True)
    for name in args.workloads or bundled:
        make_trace(name, args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
