"""Live elasticity: a lost node costs the survivors seconds and no sample, in the same processes
(snapshots in host memory with a buddy copy, the agreement on who is left, the new world, ZeRO 3
re-partitioned)."""
