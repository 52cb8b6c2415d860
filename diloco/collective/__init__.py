"""The collective data plane: members reduce among themselves over torch.distributed (SPEC.md C1-C7).

The coordinator keeps membership and the commit (the core's ``OrderReduce`` /
``ReduceReported`` / ``ApplyRound``); the tensors never reach it. What lives here:

* ``groups``   -- gloo process groups built on the coordinator's store, per group of members;
* ``reduce``   -- one round's pseudo-gradients combined, per wire dtype;
* ``replica``  -- the outer step every member runs on its own copy, and the digest it votes with;
* ``heal``     -- a joiner copies the committed state from a live member;
* ``member``   -- ``MemberMachine``: a member's protocol as a pure machine (SPEC.md M1-M8): what
  the session and the coordinator see of each other, and which job the data plane runs next;
* ``endpoint`` -- ``CollectiveEndpoint``: its real driver, between a worker's session and its
  endpoint: it turns the collective plane's messages into the hub's (a Welcome with params, a
  Result with params), so the worker session is the same on both planes;
* ``store``    -- the coordinator's side: the long-lived store the groups meet on.
"""
