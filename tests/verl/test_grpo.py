"""One real reinforcement-learning loop with VeRL's own trainer on tpu (slow: 100 to 200 s
on 2 cores).

``RayPPOTrainer`` with ``algorithm.adv_estimator=grpo`` on a local Ray cluster that Ray
sees as a 2-chip TPU host: 2 hybrid workers (actor with FSDP2 over tpu_dist, reference
policy, torch_tpu's hf rollout on each worker's chip), VeRL's agent loop and reward loop,
the weights synced into the rollout after every update. CPU fallback is an error in the
workers (TORCH_TPU_FALLBACK=error). The task (benchmarks/verl_grpo.py): copy the prompt's symbol; the reward is the
share of the response that is that symbol (a random policy scores about 1/8).
"""
import statistics

import pytest

import verl_grpo

STEPS = 30


@pytest.mark.slow
def test_grpo_reward_rises_on_tpu(tmp_path):
    metrics = verl_grpo.run("tpu", STEPS, str(tmp_path), fallback="error")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    reward = verl_grpo.reward_curve(metrics)
    first, last = statistics.mean(reward[:5]), statistics.mean(reward[-5:])
    print(f"reward by step: {[round(r, 3) for r in reward]}")
    assert last > first + 0.2, (first, last, reward)
    for m in metrics:
        # Every phase ran: rollout, reference, update, and the sync into the rollout.
        for phase in ("gen", "ref", "old_log_prob", "update_actor", "update_weights"):
            assert m[f"timing_s/{phase}"] > 0, (phase, m["step"])
        # The rollout sampled from the actor's weights: the actor (FSDP2, float32), recomputing
        # the sampled tokens' probabilities, agrees with the rollout's to float32 rounding
        # (VeRL's own check; the runs measured about 1e-7).
        assert m["training/rollout_probs_diff_max"] < 1e-4, m["training/rollout_probs_diff_max"]
        assert m["actor/pg_loss"] == m["actor/pg_loss"]  # not NaN
