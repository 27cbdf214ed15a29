"""The trajectory side of a HOPE run: its metadata, and each executed step as a
`hope_keras.search.trajectory.Step` with the live sizes after it.

A step is counted (`hope_keras.search.sizes.SizeCounter`) and appended all or nothing:
if either fails, the counts are put back as they were.
"""

from __future__ import annotations

from hope_keras.search.trajectory import Step, Trajectory


def new_trajectory(encoder, fingerprint: str) -> Trajectory:
    """An empty trajectory holding the run's model identity and options."""
    enc = encoder
    trajectory = Trajectory({
        "model_name": enc.model.name,
        "fingerprint": fingerprint,
        "groups": [[n, g.size] for n, g in enc.graph.groups.items()],
        "blocks": [b.name for b in enc.graph.blocks],
        "block_groups": {b.name: list(b.groups) for b in enc.graph.blocks},
        "num_neurons": enc.num_neurons,
        "num_params": enc.sizes.params0,
        "num_flops": enc.sizes.flops0,
        "capacities": {n: g.C_init for n, g in enc.groups.items()},
        "options": {"cost": enc.cost.get_config(), "actions": sorted(enc.actions),
                    "merge_scale": enc.merge_scale, "refresh": enc.refresh,
                    "kernel": enc.kernel,
                    "mean_compensation": bool(enc.cost.mean_compensation),
                    "merge_candidates": enc.merges.merge_candidates,
                    "merge_search": enc.merges.merge_search,
                    # the correction applied after the steps (set when applied)
                    "correct_statistics": False},
    })
    if enc.rounding.multiple > 1:
        trajectory.meta["options"]["round_to"] = enc.rounding.multiple
    return trajectory


class StepRecorder:
    """Counts each executed step and appends it to the run's trajectory.

    Args:
        trajectory: The run's `hope_keras.Trajectory` (appended to).
        sizes: The run's `hope_keras.search.sizes.SizeCounter` (updated).
        blocks: The run's residual blocks by name (an eviction's layers and groups).
    """

    def __init__(self, trajectory: Trajectory, sizes, blocks):
        self.trajectory = trajectory
        self.sizes = sizes
        self.blocks = blocks

    def record(self, action, c_before, c_after, active_before, active_after, coef,
               changed_groups, evict=False) -> Step:
        """Updates the live size counts and appends the step (O(touched layers))."""
        counter = self.sizes
        unit = action.unit
        touched = set()
        for g in changed_groups:
            touched |= counter.layers_of[g]
        if evict:
            touched |= set(self.blocks[unit].branch_layers)
        touched &= set(counter.params_now)
        lives = {unit} if not evict else set(self.blocks[unit].groups)
        saved = counter.save(touched, lives, evict)
        try:
            if evict:
                counter.evict(self.blocks[unit].branch_layers, self.blocks[unit].groups)
            else:
                counter.remove(unit, active_before - active_after)
            counter.update(touched)
            step = Step(action.kind, unit, int(action.i), int(action.j), float(action.J),
                        float(action.P_init), float(action.DR), float(c_before),
                        float(c_after), int(active_after), float(counter.params_ratio),
                        tuple(coef), float(counter.flops_ratio))
            self.trajectory.append(step)
        except BaseException:
            counter.restore(saved)
            raise
        return step
