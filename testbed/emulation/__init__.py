"""The emulated testbed: every inventory node with an ``emulated:`` section becomes a network
namespace with a management and a data veth, its own sshd, and a CPU-quota cgroup (``netns``
mode), or, without root, an sshd on loopback (``local`` mode)."""
