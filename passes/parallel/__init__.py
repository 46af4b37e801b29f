"""Distribution over the mesh: gradient reduction, ZeRO parameter sharding and gather waits."""
