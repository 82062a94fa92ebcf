"""The trainer's last stage: final validation, evaluation at ``eval.lengths``, the probes,
results.json, the run's figures, the tracker's summary and the status ``completed``.

:class:`FinalEvaluation` is a part of :class:`posbench.train.trainer.Trainer` (its attributes are
the trainer's), kept apart so that the trainer's module reads as its stages.
"""

from __future__ import annotations

from posbench.evaluation.probes import ProbeRun, probe_summaries, run_probes
from posbench.runs.results import versions
from posbench.runs.results_types import Results, TrainRecord
from posbench.runtime.distributed import barrier, shutdown


class FinalEvaluation:
    """The final-evaluation stage of the :class:`posbench.train.trainer.Trainer`."""

    def final_evaluation(self) -> Results:
        """Rank 0: final validation, evaluation at eval.lengths, results.json, figures, status."""
        t, spec, run_dir = self.t, self.spec, self.run_dir
        results: Results = {}  # type: ignore[typeddict-item]  # rank 0 fills it in; the other ranks return it empty
        if self.is_main:
            raw_model, tokens_per_step = self.raw_model, self.tokens_per_step
            val_loss = self.validate(self.total_steps)
            results = self.workload.evaluate(raw_model, spec, self.device, self.amp_dtype, self.log)
            results.update(run_probes(raw_model, self.workload.text, spec.eval,  # eval.probes
                                      ProbeRun.of(spec.eval, t.context, self.device, self.amp_dtype, self.log)))
            train_tokens = self.total_steps * tokens_per_step
            train: TrainRecord = {
                "tokens": train_tokens, "steps": self.total_steps, "final_loss": self.loss_value,
                "final_val_loss": val_loss,
                "epochs": train_tokens / max(1, self.batches.steps_per_epoch * tokens_per_step),
                # Over the whole run (all resumed segments): training tokens / training time, where
                # training time is wall time less periodic validation and checkpoint writing.
                "tokens_per_second": train_tokens / max(self.wall - self.overhead_total, 1e-9),
                "wall_seconds": self.wall, "overhead_seconds": self.overhead_total, "device": self.device.type,
                "world_size": self.dist_info.world_size, "resumed_from_step": self.start_step or None,
                # The in-training validation subsets (metrics.jsonl keys -> windows; see validation_sets).
                "validation_windows": {name: int(rows.shape[0]) for name, rows in self.val_sets.items()},
            }
            if raw_model.position.switched_at_step is not None:  # drope: the step its positions were dropped after
                train["position_dropped_after_step"] = raw_model.position.switched_at_step
            if self.state_passing.active:
                train["state_passing"] = self.state_passing.record()
            results["train"] = train
            results["run_name"] = spec.run_name
            results["method"] = self.train_positions.label  # rope+rand2048 stays apart from rope in tables
            results["model"] = {**spec.model.to_dict(), "parameters": raw_model.num_parameters(),
                                "non_embedding_parameters": raw_model.num_parameters(non_embedding=True)}
            results["method_options"] = spec.method_options
            results["data"] = self.workload.record()
            results["versions"] = versions()
            results["environment"] = self.environment
            self.rundir.write_results(results, self.log)  # under the results lock; a damaged one set aside
            figures = []
            if spec.eval.figures:
                # imported here: it loads matplotlib, which a refused start never needs
                from posbench.report.plot import write_run_figures

                figures = write_run_figures(run_dir, self.log)
            self.run_logger.log_eval(results["eval"], t.context)
            self.run_logger.summary({"train/final_loss": self.loss_value,
                                     "train/tokens_per_second": results["train"]["tokens_per_second"],
                                     **probe_summaries(results),
                                     **self.workload.summary(results)})
            self.run_logger.log_figures(figures)
            self.rundir.write_status("completed", method=spec.method, seed=spec.seed)
            self.log(f"done: {self.rundir.results_path}; {self.workload.done_line(results, t.context)}")
        self.run_logger.finish(exit_code=0)
        # Other ranks wait here while rank 0 evaluates: tearing the process group down on some ranks
        # while another still runs left a rank hanging at exit (seen intermittently with gloo).
        barrier(self.dist_info)
        shutdown(self.dist_info)
        return results
