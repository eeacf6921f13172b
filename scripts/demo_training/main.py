"""The whole run, in order: data, kernel choice, training, export into a temporary folder, evaluation, reports, rename into place."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


import numpy as np
import torch

from demo_training.corpus import Corpus, build_heldout_sample, load_corpus
from demo_training.evaluate import dir_size, final_evaluation
from demo_training.export import export_model, verify_tokenizer
from demo_training.model import DemoMoeForCausalLM, choose_experts_impl, init_weights
from demo_training.report import write_reports
from demo_training.settings import CorpusSettings, EOS_TOKEN, ModelShape, SIZE_BUDGET_BYTES, TrainSettings, _T0, hardware_info, log, parse_args, settings_from_args, training_budget_s
from demo_training.tokenizer import encode_documents, tokenizer_training_texts, train_tokenizer, wrap_hf_tokenizer
from demo_training.train import TrainResult, seed_everything, train

def install_output(tmp_dir: Path, out_dir: Path) -> None:
    """Atomically replace out_dir by tmp_dir (same parent, so rename never copies)."""
    backup = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        out_dir.rename(backup)
    tmp_dir.rename(out_dir)
    if backup.exists():
        shutil.rmtree(backup)


@dataclass
class PreparedData:
    corpus: Corpus
    sample_text: str
    sample_files: list[str]
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_train_bytes: int
    eos_id: int
    train_tokens: np.ndarray
    heldout_tokens: np.ndarray


def prepare_data(settings: CorpusSettings, vocab_size: int, seed: int, timings: dict[str, float]) -> PreparedData:
    """Corpus, held-out sample, tokenizer and token streams (each phase timed: they eat into the budget)."""
    t = time.time()
    corpus = load_corpus(settings, seed)
    sample_text, sample_files = build_heldout_sample(corpus.heldout, settings)
    timings["corpus"] = time.time() - t
    log(
        f"corpus: {corpus.stats['train_files']} train files ({corpus.stats['train_bytes'] / 1e6:.1f} MB), "
        f"{corpus.stats['heldout_files']} held-out ({corpus.stats['heldout_bytes'] / 1e6:.2f} MB), "
        f"sample {len(sample_text.encode()):,} bytes from {len(sample_files)} files [{timings['corpus']:.1f}s]"
    )
    t = time.time()
    tok_texts = tokenizer_training_texts(corpus.train, settings.tokenizer_train_bytes)
    tok_bytes = sum(len(x.encode()) for x in tok_texts)
    tokenizer = train_tokenizer(tok_texts, vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    timings["tokenizer_training"] = time.time() - t
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, eos id {eos_id}, trained on {tok_bytes / 1e6:.1f} MB "
        f"[{timings['tokenizer_training']:.1f}s]"
    )
    t = time.time()
    train_tokens = encode_documents(tokenizer, corpus.train, eos_id)
    heldout_tokens = encode_documents(tokenizer, corpus.heldout, eos_id)
    timings["tokenization"] = time.time() - t
    corpus.stats.update(train_tokens=int(train_tokens.size), heldout_tokens=int(heldout_tokens.size))
    log(
        f"tokenized: {train_tokens.size:,} train tokens, {heldout_tokens.size:,} held-out tokens "
        f"[{timings['tokenization']:.1f}s]"
    )
    return PreparedData(corpus, sample_text, sample_files, tokenizer, tok_bytes, eos_id, train_tokens, heldout_tokens)


def export_and_verify(
    result: TrainResult, data: PreparedData, shape: ModelShape, settings: TrainSettings, tmp_dir: Path
) -> dict[str, Any]:
    """Write model, tokenizer and held-out sample into tmp_dir and check they load as intended."""
    export_model(result.best_state, shape, data.eos_id, settings.router_aux_loss_coef, tmp_dir)
    wrap_hf_tokenizer(data.tokenizer, shape.max_position_embeddings).save_pretrained(tmp_dir)
    (tmp_dir / "heldout_sample.txt").write_text(data.sample_text, encoding="utf-8")
    return verify_tokenizer(tmp_dir, data.eos_id, data.sample_text[:4000])


def run_stats(
    command: str,
    shape: ModelShape,
    corpus_settings: CorpusSettings,
    settings: TrainSettings,
    data: PreparedData,
    impl: str,
    impl_report: dict[str, Any],
    budget_s: float,
    result: TrainResult,
    tokenizer_report: dict[str, Any],
    evaluation: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """Everything training_stats.json records (and MODEL_CARD.md renders)."""
    return {
        "command": command,
        "shape": dataclasses.asdict(shape),
        "parameters": shape.param_counts(),
        "eos_token_id": data.eos_id,
        "corpus": data.corpus.stats,
        "corpus_settings": dataclasses.asdict(corpus_settings),
        "heldout_sample_files": data.sample_files,
        "tokenizer": {**tokenizer_report, "train_bytes": data.tokenizer_train_bytes},
        "hardware": hardware_info(device),
        "training": {
            "experts_impl": impl,
            "experts_impl_report": impl_report,
            "precision": "bf16 autocast, fp32 master weights"
            if device.type == "cuda"
            else "fp32 (grouped expert GEMMs in bf16)",
            "settings": dataclasses.asdict(settings),
            "budget_s": budget_s,
            "steps": result.steps,
            "tokens": result.tokens,
            "tokens_per_step": settings.batch_seqs * settings.seq_len,
            "epochs": result.epochs,
            "seconds": result.seconds,
            "stop_reason": result.stop_reason,
            "best_step": result.best_step,
            "best_heldout_loss": result.best_heldout_loss,
            "curve": result.curve,
        },
        "evaluation": evaluation,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    command = " ".join(["python3 scripts/train_demo_model.py", *(sys.argv[1:] if argv is None else argv)])
    shape, corpus_settings, settings = settings_from_args(args)
    budget_estimate = shape.check_budget()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        log("WARNING: no CUDA device; a full run on CPU will train very little")
    seed_everything(settings.seed)
    log(f"shape {shape}; est. output {budget_estimate / 1e6:.2f} MB of {SIZE_BUDGET_BYTES / 1e6:.0f} MB; {device}")
    timings: dict[str, float] = {}

    data = prepare_data(corpus_settings, shape.vocab_size, settings.seed, timings)
    shape = dataclasses.replace(shape, vocab_size=data.tokenizer.get_vocab_size())
    shape.check_budget()

    t = time.time()
    model = DemoMoeForCausalLM(shape)
    init_weights(model, settings.init_std)
    model.to(device)
    micro_tokens = settings.micro_batch_seqs * settings.seq_len
    impl, impl_report = choose_experts_impl(settings.experts_impl, shape, micro_tokens, device, device.type == "cuda")
    model.set_experts_impl(impl)
    if impl == "grouped":  # activations are small without the dense path's E-wide tensors: no accumulation
        settings = dataclasses.replace(settings, micro_batch_seqs=settings.batch_seqs)
    timings["kernel_selection"] = time.time() - t

    budget_s = training_budget_s(settings)
    log(f"training for up to {budget_s / 60:.2f} min with experts impl '{impl}'")
    result = train(model, data.train_tokens, data.heldout_tokens, settings, device, budget_s)
    timings["training"] = result.seconds
    log(f"training done: {result.steps} steps, {result.tokens:,} tokens, stop: {result.stop_reason}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    out_dir = args.out.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    t = time.time()
    tokenizer_report = export_and_verify(result, data, shape, settings, tmp_dir)
    timings["export"] = time.time() - t
    t = time.time()
    evaluation = final_evaluation(tmp_dir, shape, data.sample_text, device)
    timings["final_eval"] = time.time() - t

    stats = run_stats(
        command,
        shape,
        corpus_settings,
        settings,
        data,
        impl,
        impl_report,
        budget_s,
        result,
        tokenizer_report,
        evaluation,
        device,
    )
    timings["total"] = time.time() - _T0
    stats["timings_s"] = timings
    write_reports(tmp_dir, stats)
    for path in tmp_dir.iterdir():
        path.chmod(0o644)  # save_pretrained leaves model.safetensors owner-only
    total_bytes = dir_size(tmp_dir)
    if total_bytes > SIZE_BUDGET_BYTES:
        raise SystemExit(f"output is {total_bytes / 1e6:.2f} MB > {SIZE_BUDGET_BYTES / 1e6:.0f} MB; left in {tmp_dir}")
    install_output(tmp_dir, out_dir)
    log(
        f"wrote {out_dir} ({total_bytes / 1e6:.2f} MB): held-out perplexity {evaluation['perplexity']:.3f}; "
        f"total {timings['total'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
