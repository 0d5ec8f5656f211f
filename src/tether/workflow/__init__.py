"""Workflows: DAGs of tasks whose steps are recovered like tasks are (DESIGN.md section 6)."""
