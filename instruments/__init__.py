"""What stands on the reference: the timeline, statistics, reports, dashboard, formulas, planner, HF import/export."""
