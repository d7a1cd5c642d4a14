"""placeholder"""
PLANS: dict = {}
