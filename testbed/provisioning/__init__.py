"""What a node is given before any run: its Python environment and record (``provision``), the node code and
its wheel (``node_code``, ``node_wheel``), model weights (``weights``), the sudo rules the suite needs
(``sudo_rules``) and the NFQUEUE delay handler's launcher (``delay_handler``)."""
