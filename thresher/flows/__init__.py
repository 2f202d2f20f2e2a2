"""Prefect flows and tasks, MLflow tracking, publishing, deployments and schedules."""
