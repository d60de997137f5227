"""The training progress bar the training commands share (``train``, ``distill self``, ``distill pump``), and the
line an on-policy run starts with: how many candidates Kiln's auto-scaling planned, and a first ETA."""

from __future__ import annotations


class ProgressBar:
    """A tqdm bar on stderr, created on the first step (when the total is known).

    An on-policy run first prints its effective candidate count (prompts × samples_per_prompt × epochs,
    after Kiln's auto-scaling of the default samples_per_prompt) and a first ETA: the time its loop took
    for the rollouts sampled so far, per candidate, times the candidates left (the bar's own ETA follows).
    """

    def __init__(self, enabled: bool, config=None) -> None:
        self.enabled = enabled
        self.config = config
        self.bar = None

    def update(self, step: int, total: int, loss: float, rollout=None) -> None:
        """``rollout`` (an ``OnPolicyProgress``, on-policy runs only): ``step`` counts consumed candidates."""
        if not self.enabled:
            return
        if self.bar is None:
            import sys

            from tqdm import tqdm

            if rollout is not None:
                print(on_policy_start_line(step, total, rollout, self.config), file=sys.stderr, flush=True)
            unit = "step" if rollout is None else "candidate"
            self.bar = tqdm(total=total, initial=step - 1, desc="train", unit=unit, file=sys.stderr)
        self.bar.update(step - self.bar.n)
        if rollout is None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        else:
            self.bar.set_postfix(loss=f"{loss:.4f}", rollouts_per_s=f"{rollout.rollouts_per_second:.2f}",
                                 teacher_tokens=rollout.teacher_tokens_scored, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def on_policy_start_line(consumed: int, total: int, rollout, config=None) -> str:
    """``on-policy: 128 candidates (2 prompts × 64 samples_per_prompt × 1 epoch); ETA ~5m30s`` at the first step."""
    work_done = max(rollout.rollouts_sampled + rollout.rollouts_reused, 1)
    eta = rollout.elapsed_s / work_done * max(total - consumed, 0)
    return f"on-policy: {total} candidates{_breakdown(total, config)}; ETA ~{_duration(eta)}"


def _breakdown(total: int, config) -> str:
    """`` (P prompts × S samples_per_prompt × E epochs)``, or '' when the config does not explain ``total``."""
    if config is None:
        return ""
    from kiln_core.contracts.opd_config import effective_samples_per_prompt

    epochs = config.epochs
    for samples in dict.fromkeys((config.samples_per_prompt, 64, 16, 4)):
        prompts, rest = divmod(total, max(samples * epochs, 1))
        if not rest and prompts and effective_samples_per_prompt(config, prompts) == samples:
            scaled = "; Kiln's rule scaled the default samples_per_prompt" if samples != config.samples_per_prompt else ""
            return (f" ({prompts} prompt{'s' * (prompts != 1)} × {samples} samples_per_prompt × "
                    f"{epochs} epoch{'s' * (epochs != 1)}{scaled})")
    return ""


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
