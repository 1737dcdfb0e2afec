"""What the agent did: every trajectory of a step to `trajectories.jsonl`, and a few printed turn
by turn (`logging.print_samples`)."""

from __future__ import annotations

import json
from pathlib import Path

from skyrl_trainer.trainer.rollouts import Group


def trajectory_records(step: int, groups: list[Group], dropped: bool = False) -> list[dict]:
    """One JSON-ready record per trajectory: turns (action text, observation messages, reward,
    stop reason, token counts), return, end reason, error, environment metrics; in asynchronous
    runs also the weights version that sampled it, the group's start index (streaming), and
    whether it was dropped as too old."""
    records = []
    for g, group in enumerate(groups):
        for i, rollout in enumerate(group.rollouts):
            records.append(
                {
                    "step": step,
                    "group": g,
                    "index": i,
                    "group_id": group.index,
                    "sampler_version": rollout.sampler_version,
                    "dropped": dropped,
                    "answer": group.problem.sample.get("answer"),
                    "prompt_tokens": len(rollout.prompt_tokens),
                    "reward": rollout.reward,
                    "correct": rollout.correct,
                    "end_reason": rollout.end_reason,
                    "stop_reason": rollout.stop_reason,
                    "error": rollout.reward_error,
                    "env_metrics": rollout.env_metrics,
                    "turns": [
                        {
                            "action": t.action,
                            "action_tokens": t.action_tokens,
                            "stop_reason": t.stop_reason,
                            "reward": t.reward,
                            "observation": t.observation,
                            "observation_tokens": t.observation_tokens,
                            "env_seconds": round(t.env_seconds, 4),
                            "tool_call": t.tool_call,
                            "tool_error": t.tool_error,
                        }
                        for t in rollout.turns
                    ],
                }
            )
    return records


def append_trajectories(
    output_dir: Path, step: int, groups: list[Group], dropped: list[Group] = ()
) -> None:
    path = Path(output_dir) / "trajectories.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = trajectory_records(step, groups) + trajectory_records(step, list(dropped), True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")


def print_trajectories(groups: list[Group], limit: int) -> None:
    """The first `limit` trajectories, one line per action and per observation."""
    shown = [(g, r) for g in groups for r in g.rollouts][:limit]
    for group, rollout in shown:
        answer = group.problem.sample.get("answer")
        print(
            f"  [reward {rollout.reward:.2f} | answer {answer} | {len(rollout.turns)} turn(s), "
            f"{rollout.end_reason}{' | ' + rollout.reward_error if rollout.reward_error else ''}]",
            flush=True,
        )
        for n, turn in enumerate(rollout.turns, 1):
            text = turn.action.replace("\n", "\\n")[:400]
            print(f"    {n}> {text}", flush=True)
            for message in turn.observation:
                content = str(message.get("content", "")).replace("\n", "\\n")[:300]
                print(f"    {n}< [{message.get('role', '?')}] {content}", flush=True)
