"""Prefect flows and tasks, the content-addressed store, publishing, deployments and schedules."""
