"""``diloco demo``: a real DiLoCo run with a fault, against sync data parallel and a single worker."""
