"""`perseus agent`: the one process per node that writes GPU clocks and power limits.

Training processes run unprivileged: their GPUs' reads stay direct, their writes go to the agent
over a Unix socket (perseus.devices.agent_gpu), which grants each process a lease on the GPUs it
controls and restores a GPU's defaults the moment the lease ends -- the connection closes (any
exit, any kill) or its heartbeats stop.

  location  where the agent's socket is ($PERSEUS_AGENT, /run/perseus/agent.sock), when GPUs use it, and
            a word to a process that changes simulated GPUs itself while an agent serves some
  protocol  the frames and messages on the socket (msgpack, every field checked)
  peer      the connecting process's credentials (SO_PEERCRED)
  leases    who holds which GPU, persisted so that a restarted agent resets what it no longer holds
  daemon    the agent: the socket, one thread per connection, heartbeats, resets
  client    a process's connection to the agent (shared by its GPUs; heartbeats off the training thread)
  sim_folder  the agent's simulated GPUs' folder: state its own, activity open to its clients, a marker

This package imports nothing heavy at the top: device selection reads `location` on every call.
"""
