"""Pipeline parallelism: action vocabulary, schedules (pure data), simulator/validator, engine."""
