"""The RL math as pure torch functions: advantage estimators (``advantages``), policy and value
losses (``losses``), KL estimators (``kl``), DAPO's group filter (``dynamic_sampling``) and the
padded training batch (``batch``); also, in plain Python, learning-rate schedules (``schedules``)
and where a response ends on a stop string (``stop_strings``). Nothing here knows of Ray, the bus
or roles.
"""
