"""The RL math as pure torch functions: advantage estimators (``advantages``), policy losses
(``losses``) and the padded training batch (``batch``). Nothing here knows of Ray, the bus or roles.
"""
