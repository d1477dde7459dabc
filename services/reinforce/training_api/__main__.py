from reinforce.training_api.main import main

main()
