"""The solver programs: ``make_solver`` is the one place a solver is made, ``cbc`` (PuLP's
bundled CBC) or ``highs`` (highspy through PuLP, without its banner and with a callback).
"""
from __future__ import annotations

import warnings

import pulp

from planner.errors import UserError
from planner.solve.highs import available as highs_available, quiet as _quiet_highs


SOLVERS = ("cbc", "highs")


class _QuietHiGHS(pulp.HiGHS):
    """PuLP's HiGHS without the banner ``highspy.Highs()`` prints on stdout before any option
    can silence it (``plan solve`` prints the plan's path as its first stdout line), with an
    optional callback on HiGHS's MIP interrupt event (progress, and stopping on Ctrl-C)."""

    def __init__(self, *a, callback=None, start=None, **k):
        super().__init__(*a, **k)
        self.callback = callback
        self.start = start          # {variable name: value}: a MIP start (HiGHS checks it)
        self.neighbourhoods = True  # HiGHS's own RINS and RENS (off where ours races it)

    def createAndConfigureSolver(self, lp):
        h = _quiet_highs()
        h.setOptionValue("output_flag", bool(self.msg))
        for key, val in (("mip_rel_gap", self.gapRel), ("threads", self.threads),
                         ("time_limit", None if self.timeLimit is None else float(self.timeLimit))):
            if val is not None:
                h.setOptionValue(key, val)
        if self.callback is not None:
            h.cbMipInterrupt.subscribe(self.callback)
        if not self.neighbourhoods:
            h.setOptionValue("mip_heuristic_run_rins", False)
            h.setOptionValue("mip_heuristic_run_rens", False)
        lp.solverModel = h

    def buildSolverModel(self, lp):
        super().buildSolverModel(lp)
        if self.start:
            import highspy
            sol = highspy.HighsSolution()
            sol.col_value = [float(self.start.get(v.name, 0.0)) for v in lp.variables()]
            sol.value_valid = True
            lp.solverModel.setSolution(sol)


def make_solver(name: str, time_limit: float | None, gap: float, warm: bool, tmp_dir: str,
                log_path: str | None, callback=None, start: dict | None = None):
    """``cbc`` (PuLP's bundled CBC) or ``highs`` (highspy); the one place a solver is made."""
    if name == "cbc":
        # NB: PuLP 3.x warns that its bundled CBC goes away in PuLP 4; we pin pulp<4 for it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm,
                                  logPath=log_path, threads=1)
        s.tmpDir = tmp_dir           # its MPS, solution and start files go where we clean up
        return s
    if name == "highs":
        if not highs_available():
            raise UserError("--solver highs: highspy is not installed; pip install highspy "
                            "(bash setup.sh installs it) or use --solver cbc")
        return _QuietHiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1,
                           callback=callback, start=start)
    raise UserError(f"--solver '{name}': unknown solver; use {' or '.join(SOLVERS)}")
